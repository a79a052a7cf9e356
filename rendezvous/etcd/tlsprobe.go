package etcd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"
)

// gRPC hides why a connection could not be made: an RPC on a channel whose
// TLS handshakes fail just waits, then times out. So, with TLS on, Connect
// first shakes hands with every endpoint itself and reads the typed error
// crypto/tls gives.

// http2Preface is what an HTTP/2 client sends first, then an empty
// SETTINGS frame. With TLS 1.3 a server checks the client's certificate
// after the client's handshake is done, and says so on the client's first
// read: sending the preface makes the server answer, with its own SETTINGS
// or with the alert.
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + "\x00\x00\x00\x04\x00\x00\x00\x00\x00"

// probeTLS shakes hands with every endpoint (URLs) at once, as the client
// will. It returns an error wrapping ErrTLS when no endpoint completed the
// handshake and at least one failed on TLS itself; an endpoint that cannot
// be reached at all says nothing about certificates.
func probeTLS(ctx context.Context, endpoints []string, cfg *tls.Config, timeout time.Duration) error {
	errs := make([]error, len(endpoints))
	var wg sync.WaitGroup
	for i, ep := range endpoints {
		wg.Go(func() { errs[i] = probeOne(ctx, ep, cfg, timeout) })
	}
	wg.Wait()
	var tlsErrs []error
	for _, err := range errs {
		switch {
		case err == nil:
			return nil // one member speaks our TLS: the client can use it
		case errors.Is(err, ErrTLS):
			tlsErrs = append(tlsErrs, err)
		}
	}
	if len(tlsErrs) == 0 {
		return nil
	}
	return tlsErrs[0]
}

// probeOne returns nil when ep completed a handshake, an error wrapping
// ErrTLS when the handshake failed on TLS, and another error when ep could
// not be reached.
func probeOne(ctx context.Context, ep string, base *tls.Config, timeout time.Duration) error {
	u, err := url.Parse(ep)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cfg := base.Clone()
	cfg.NextProtos = []string{"h2"}
	d := tls.Dialer{Config: cfg}
	conn, err := d.DialContext(ctx, "tcp", u.Host)
	if err != nil {
		if err = classifyTLS(u.Host, err, len(cfg.Certificates) > 0); !errors.Is(err, ErrTLS) && speaksHTTP(ctx, u.Host) {
			// A plain member hangs up on a ClientHello without a word.
			err = fmt.Errorf("%w with %s: the endpoint speaks plain HTTP, not TLS (use protocol=http)", ErrTLS, u.Host)
		}
		return err
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	conn.SetDeadline(deadline)
	if _, err := conn.Write([]byte(http2Preface)); err != nil {
		return classifyTLS(u.Host, err, len(cfg.Certificates) > 0)
	}
	var b [1]byte
	if _, err := conn.Read(b[:]); err != nil {
		return classifyTLS(u.Host, err, len(cfg.Certificates) > 0)
	}
	return nil
}

// classifyTLS turns a handshake's error into one wrapping ErrTLS with a
// hint at the certificate to check, or returns it as it is when it is not
// about TLS (no connection, a timeout, a reset).
func classifyTLS(host string, err error, hasCert bool) error {
	var (
		unknown  x509.UnknownAuthorityError
		hostname x509.HostnameError
		invalid  x509.CertificateInvalidError
		record   tls.RecordHeaderError
		op       *net.OpError
	)
	var hint string
	switch {
	case errors.As(err, &unknown):
		hint = "etcd's certificate is not signed by a CA in cacert"
	case errors.As(err, &hostname):
		hint = fmt.Sprintf("etcd's certificate does not name %s (its SANs must include the endpoint's host)", host)
	case errors.As(err, &invalid):
		hint = "etcd's certificate is not valid (expired, or not for a server?)"
	case errors.As(err, &record):
		hint = "the endpoint does not speak TLS (is it http, not https?)"
	case errors.As(err, &op) && op.Op == "remote error" && !hasCert:
		hint = "etcd asks for a client certificate: set cert and key"
	case errors.As(err, &op) && op.Op == "remote error":
		hint = "etcd refused this client's certificate (check cert and key: etcd's --trusted-ca-file must have signed cert)"
	case strings.HasPrefix(err.Error(), "tls: "):
		hint = "no TLS session could be agreed"
	default:
		return err
	}
	return fmt.Errorf("%w with %s: %v: %s", ErrTLS, host, err, hint)
}

// speaksHTTP reports whether a plain HTTP server is at host:port: etcd
// answers GET /version.
func speaksHTTP(ctx context.Context, host string) bool {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		return false
	}
	defer conn.Close()
	if deadline, ok := ctx.Deadline(); ok {
		conn.SetDeadline(deadline)
	}
	if _, err := conn.Write([]byte("GET /version HTTP/1.0\r\n\r\n")); err != nil {
		return false
	}
	b := make([]byte, 5)
	_, err = io.ReadFull(conn, b)
	return err == nil && string(b) == "HTTP/"
}

// speaksTLS reports whether a TLS server is at host:port: it completes a
// handshake, whoever it is, or refuses this client by an alert. (A TLS
// member hangs up on a plain request without a word.)
func speaksTLS(ctx context.Context, host string) bool {
	d := tls.Dialer{Config: &tls.Config{InsecureSkipVerify: true}} // only to see whether TLS is spoken
	conn, err := d.DialContext(ctx, "tcp", host)
	if err == nil {
		conn.Close()
		return true
	}
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "remote error"
}

// probePlain is probeTLS's counterpart for plain HTTP endpoints, run after
// an attempt failed: an error wrapping ErrTLS when no endpoint speaks plain
// HTTP and at least one speaks TLS.
func probePlain(ctx context.Context, endpoints []string, timeout time.Duration) error {
	plain, secure := make([]bool, len(endpoints)), make([]bool, len(endpoints))
	var wg sync.WaitGroup
	for i, ep := range endpoints {
		wg.Go(func() {
			u, err := url.Parse(ep)
			if err != nil {
				return
			}
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			if plain[i] = speaksHTTP(ctx, u.Host); !plain[i] {
				secure[i] = speaksTLS(ctx, u.Host)
			}
		})
	}
	wg.Wait()
	found := -1
	for i := range endpoints {
		switch {
		case plain[i]:
			return nil
		case secure[i]:
			found = i
		}
	}
	if found < 0 {
		return nil
	}
	return fmt.Errorf("%w with %s: the endpoint speaks TLS, not plain HTTP (use protocol=https with cacert, and cert and key if etcd asks for client certificates)",
		ErrTLS, strings.TrimPrefix(endpoints[found], "http://"))
}
