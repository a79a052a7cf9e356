package launcher

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
)

// Secret is the job secret (Config.JobSecret): the key every agent of a
// job holds, and its workers, so that what one writes for the others to
// act on can be told from what anyone who reaches a port could write. It
// prints as "[redacted]" however it is formatted, so that no log line,
// error or dump of a Config carries it.
type Secret []byte

// MinSecretLen is the shortest job secret accepted: 16 bytes, 128 bits if
// they are random.
const MinSecretLen = 16

// JobSecretEnv is the environment variable that holds the job secret, for
// an agent (instead of --job-secret-file) and for every worker.
const JobSecretEnv = "GORUN_JOB_SECRET"

func (Secret) String() string   { return "[redacted]" }
func (Secret) GoString() string { return "[redacted]" }

// MarshalText keeps the secret out of any encoding of a Config.
func (Secret) MarshalText() ([]byte, error) { return []byte("[redacted]"), nil }

// NewSecret makes a random job secret (--standalone's): 32 random bytes,
// hex-encoded so that it travels as text in an environment.
func NewSecret() Secret {
	var b [32]byte
	rand.Read(b[:])
	return Secret(hex.EncodeToString(b[:]))
}

// ParseSecret checks a job secret given as text (GORUN_JOB_SECRET, or a
// file's contents): surrounding white space, a file's final newline
// included, is not part of it.
func ParseSecret(text string) (Secret, error) {
	s := strings.TrimSpace(text)
	if len(s) < MinSecretLen {
		return nil, fmt.Errorf("the job secret is %d bytes: want at least %d (e.g. `openssl rand -hex 32`)", len(s), MinSecretLen)
	}
	return Secret(s), nil
}

// ReadSecretFile reads the job secret from path (--job-secret-file: a
// Kubernetes Secret mounted as a file, say).
func ReadSecretFile(path string) (Secret, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("job secret file: %w", err)
	}
	s, err := ParseSecret(string(b))
	if err != nil {
		return nil, fmt.Errorf("job secret file %s: %w", path, err)
	}
	return s, nil
}

// derive returns a key of its own for one use of the secret (purpose
// names it), so that no two mechanisms share key bytes.
func (s Secret) derive(purpose string) []byte {
	h := sha256.New()
	h.Write([]byte("gorun job secret\x00" + purpose + "\x00"))
	h.Write(s)
	return h.Sum(nil)
}

// check is what a node publishes in the rendezvous to show which secret
// it holds, "" for none: 16 bytes of a derived key, hex. Nodes compare
// checks, never secrets, and a check reveals no more of the secret than
// any MAC the job writes.
func (s Secret) check(runID string) string {
	if s == nil {
		return ""
	}
	return hex.EncodeToString(s.derive("check\x00" + runID)[:16])
}
