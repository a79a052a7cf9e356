package launcher

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
)

func validateEndpoint(endpoint string, defaultPort int) error {
	if _, _, err := splitEndpoint(endpoint, defaultPort); err != nil {
		return invalidf("--rdzv-endpoint: %w", err)
	}
	return nil
}

// splitEndpoint reads host[:port] as torchrun's parse_rendezvous_endpoint
// does: an empty endpoint is localhost; "[v6]" is a host without a port;
// otherwise the endpoint splits at its last ':' ("node0:29400",
// "[::1]:29400", and, as in torchrun, "::1:29400" is ::1 port 29400), and
// defaultPort stands in when there is no ':'. Where that split leaves no
// IPv6 address but the whole is one ("fe80::1", "::1"), gorun takes it as
// a host without a port; torchrun would fail there.
func splitEndpoint(endpoint string, defaultPort int) (host string, port int, err error) {
	e := strings.TrimSpace(endpoint)
	switch {
	case e == "":
		return "localhost", defaultPort, nil
	case strings.HasPrefix(e, "[") && strings.HasSuffix(e, "]"):
		host, port = e[1:len(e)-1], defaultPort
	case !strings.Contains(e, ":"):
		host, port = e, defaultPort
	default:
		h, p, _ := cutLast(e, ":")
		bracketed := strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]")
		if bracketed {
			h = h[1 : len(h)-1]
		}
		if !bracketed && strings.Contains(h, ":") && !isIPv6(h) {
			if isIPv6(e) {
				host, port = e, defaultPort
				break
			}
			return "", 0, fmt.Errorf("%q is not HOST[:PORT] (write an IPv6 address in brackets: [::1]:29400)", endpoint)
		}
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 || n > 65535 || len(p) > 5 {
			return "", 0, fmt.Errorf("%q: port %q is not a TCP port (0–65535)", endpoint, p)
		}
		host, port = h, n
	}
	if !validHost(host) {
		return "", 0, fmt.Errorf("%q: %q is not a host name or IP address", endpoint, host)
	}
	return host, port, nil
}

// isIPv6 reports whether s is an IPv6 address (a zone allowed).
func isIPv6(s string) bool {
	a, err := netip.ParseAddr(s)
	return err == nil && a.Is6()
}

// hostPattern is torchrun's check for an endpoint's host (labels, IPv4,
// IPv6), plus '%' for IPv6 zones.
var hostPattern = regexp.MustCompile(`^[\w.:%-]+$`)

func validHost(h string) bool { return hostPattern.MatchString(h) }

// validAddr is validHost for an address flag, where an IPv6 address may
// come in brackets ("[::1]", as torchrun's --master-addr help suggests).
func validAddr(a string) bool {
	if strings.HasPrefix(a, "[") && strings.HasSuffix(a, "]") {
		a = a[1 : len(a)-1]
	}
	return validHost(a)
}

// isLocalHost reports whether host names this machine: torchrun's is_host
// inference, which matches the endpoint against the local addresses.
func isLocalHost(host string) bool {
	if host == "localhost" {
		return true
	}
	if h, err := os.Hostname(); err == nil {
		// "job-0" hosting "job-0.job-svc" (a Kubernetes Indexed Job behind
		// a headless Service): the pod's name is the first label, and its
		// DNS record may not exist yet when it starts.
		if strings.EqualFold(h, host) || strings.HasPrefix(strings.ToLower(host), strings.ToLower(h)+".") {
			return true
		}
	}
	ips, err := net.LookupIP(host)
	if err != nil {
		return false
	}
	addrs, _ := net.InterfaceAddrs()
	for _, ip := range ips {
		if ip.IsLoopback() {
			return true
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
				return true
			}
		}
	}
	return false
}
