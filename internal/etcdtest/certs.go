package etcdtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Certs are PEM files for TLS tests, made by NewCerts: a CA, a server
// certificate signed by it for 127.0.0.1, ::1 and localhost, and a client
// certificate signed by it.
type Certs struct {
	Dir                   string
	CAFile                string
	ServerCert, ServerKey string
	ClientCert, ClientKey string
}

// NewCerts makes a fresh CA and certificates (ECDSA P-256, valid for a
// day) in a temporary directory of the test. Two calls give unrelated
// CAs: one's client certificate is a wrong certificate for the other.
func NewCerts(t testing.TB) *Certs {
	t.Helper()
	dir := t.TempDir()
	c := &Certs{
		Dir:        dir,
		CAFile:     filepath.Join(dir, "ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"),
		ServerKey:  filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"),
		ClientKey:  filepath.Join(dir, "client-key.pem"),
	}
	now := time.Now()
	caKey := newKey(t)
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: "gorun test CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, c.CAFile, "CERTIFICATE", caDER)

	leaf := func(certFile, keyFile, name string, server bool, usage ...x509.ExtKeyUsage) {
		key := newKey(t)
		tmpl := &x509.Certificate{
			SerialNumber: serial(t),
			Subject:      pkix.Name{CommonName: name},
			NotBefore:    now.Add(-time.Hour),
			NotAfter:     now.Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  usage,
		}
		if server {
			tmpl.DNSNames = []string{"localhost"}
			tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		writePEM(t, certFile, "CERTIFICATE", der)
		kb, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		writePEM(t, keyFile, "PRIVATE KEY", kb)
	}
	// etcd's server also acts as a client of itself (its gateway and
	// grpc-gateway), so its certificate is good for both.
	leaf(c.ServerCert, c.ServerKey, "etcd", true, x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth)
	leaf(c.ClientCert, c.ClientKey, "gorun", false, x509.ExtKeyUsageClientAuth)
	return c
}

// ServerTLS returns the TLS options that make etcd serve clients with the
// server certificate; clientCertAuth makes it also require client
// certificates signed by the CA.
func (c *Certs) ServerTLS(clientCertAuth bool) *TLS {
	return &TLS{CertFile: c.ServerCert, KeyFile: c.ServerKey, TrustedCAFile: c.CAFile, ClientCertAuth: clientCertAuth}
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}
