package launcher

import (
	"fmt"
	"net"
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
// does: "[v6]" and "[v6]:port" for IPv6, an empty endpoint meaning
// localhost, and defaultPort when there is no port. A bare IPv6 address
// (more than one ':') is taken as a host without a port, where torchrun
// would split off its last group.
func splitEndpoint(endpoint string, defaultPort int) (host string, port int, err error) {
	e := strings.TrimSpace(endpoint)
	switch {
	case e == "":
		return "localhost", defaultPort, nil
	case strings.HasPrefix(e, "[") && strings.HasSuffix(e, "]"):
		host, port = e[1:len(e)-1], defaultPort
	case strings.HasPrefix(e, "[") || strings.Count(e, ":") == 1:
		h, p, err := net.SplitHostPort(e)
		if err != nil {
			return "", 0, fmt.Errorf("%q is not HOST[:PORT]", endpoint)
		}
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 || n > 65535 || len(p) > 5 {
			return "", 0, fmt.Errorf("%q: port %q is not a TCP port (0–65535)", endpoint, p)
		}
		host, port = h, n
	default:
		host, port = e, defaultPort
	}
	if !validHost(host) {
		return "", 0, fmt.Errorf("%q: %q is not a host name or IP address", endpoint, host)
	}
	return host, port, nil
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
