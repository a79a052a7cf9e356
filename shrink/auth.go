package shrink

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// SecretEnv is the environment variable that carries the job secret to
// workers (its text is the HMAC key, byte for byte). Where it is unset
// the Board is not authenticated: nothing is sealed, nothing verified.
const SecretEnv = "GORUN_JOB_SECRET"

// macDomain separates the Board's MACs from any other use of the job
// secret; v1 is the record format below.
const macDomain = "gorun/shrink/v1\x00"

// ErrForged: a record on the Board failed authentication (no MAC, a MAC
// that does not match, or a mac field out of shape). Errors that wrap it
// are Forgery values.
var ErrForged = errors.New("forged record")

// ForgeryReason says why a record failed authentication.
type ForgeryReason string

const (
	// NoMAC: the record carries no mac field at all.
	NoMAC ForgeryReason = "no MAC"
	// BadMAC: the mac field is well formed and does not match the record
	// under the job secret, this round's scope and the record's key: a
	// record forged without the secret, or a genuine one replayed from
	// another key or another round.
	BadMAC ForgeryReason = "bad MAC"
	// Malformed: the record names a mac, but not as the last field with 64
	// lowercase hex digits.
	Malformed ForgeryReason = "malformed MAC"
)

// Forgery is a record the Board refused. It is an error that wraps
// ErrForged.
type Forgery struct {
	// Key is the record's key relative to the Board's prefix ("epoch/3",
	// "report/12").
	Key    string
	Reason ForgeryReason
}

func (f Forgery) Error() string { return fmt.Sprintf("shrink: %s: %s: %s", f.Key, ErrForged, f.Reason) }

func (f Forgery) Unwrap() error { return ErrForged }

// Auth authenticates the Board's records for one round of one job: the
// records it seals carry a MAC under the job secret, bound to the round
// (its scope) and to the record's key, and the records it opens must carry
// one, or they are refused as forged. One Auth is shared by every Board of
// a process that talks about the same round, so that each forged record is
// reported once, however many Boards read it.
//
// A record on an authenticated Board is the JSON readers without the
// secret parse, with one more field at the end:
//
//	{...,"mac":"<64 lowercase hex>"}
//
// where the MAC is HMAC-SHA256(secret, "gorun/shrink/v1\x00" + scope +
// "\x00" + key + "\x00" + body), key is relative to the Board's prefix,
// and body is the record without its mac field: the stored bytes with
// `,"mac":"…"` cut from before the final `}`. gorun_ft.py computes the
// same bytes.
type Auth struct {
	secret   []byte
	scope    string
	onForged func(Forgery)

	mu     sync.Mutex
	seen   map[[sha256.Size]byte]bool // digest of key and record, for each forgery reported
	forged atomic.Int64
}

// Scope names one round of one job, which an Auth binds records to: the
// run id (TORCHELASTIC_RUN_ID) and the rendezvous round (GORUN_GENERATION,
// in decimal), as every worker of the round finds them in its environment.
// A record sealed for one round is refused in any other, so an epoch of an
// earlier round cannot be replayed into this one.
func Scope(runID, generation string) string { return runID + "/" + generation }

// NewAuth returns an Auth for the round scope under secret (the job
// secret's bytes, which NewAuth copies). onForged, if not nil, is called
// once for each distinct forged record (by key and content) any of its
// Boards reads, from the goroutine that read it: it must be safe for
// concurrent use and should not block (log and count). An empty secret is
// an error: a MAC under it would prove nothing.
func NewAuth(secret []byte, scope string, onForged func(Forgery)) (*Auth, error) {
	if len(secret) == 0 {
		return nil, fmt.Errorf("shrink: authenticate the board: the job secret is empty")
	}
	return &Auth{secret: bytes.Clone(secret), scope: scope, onForged: onForged, seen: map[[sha256.Size]byte]bool{}}, nil
}

// AuthFromEnv returns the Auth that a worker's environment asks for: under
// the secret in GORUN_JOB_SECRET, for the round named by
// TORCHELASTIC_RUN_ID and GORUN_GENERATION. Without a secret it returns
// nil, nil, and Boards stay unauthenticated, as before the job secret.
func AuthFromEnv(getenv func(string) string, onForged func(Forgery)) (*Auth, error) {
	secret := getenv(SecretEnv)
	if secret == "" {
		return nil, nil
	}
	return NewAuth([]byte(secret), Scope(getenv("TORCHELASTIC_RUN_ID"), getenv("GORUN_GENERATION")), onForged)
}

// Forgeries returns how many distinct forged records the Auth's Boards
// have refused.
func (a *Auth) Forgeries() int64 { return a.forged.Load() }

// maxSeen bounds the forgeries an Auth remembers, so as to report each
// once.
const maxSeen = 4096

// macField is what precedes the MAC's hex digits in a sealed record; the
// record then ends with `"}`.
const macField = `,"mac":"`

// sealedTail is the length of a sealed record's tail after its body's
// closing brace is removed: `,"mac":"` + 64 hex digits + `"}`.
const sealedTail = len(macField) + 2*sha256.Size + 2

func (a *Auth) mac(key string, body []byte) []byte {
	m := hmac.New(sha256.New, a.secret)
	m.Write([]byte(macDomain))
	m.Write([]byte(a.scope))
	m.Write([]byte{0})
	m.Write([]byte(key))
	m.Write([]byte{0})
	m.Write(body)
	return m.Sum(nil)
}

// seal returns body, a JSON object, with its MAC for key spliced in as its
// last field.
func (a *Auth) seal(key string, body []byte) ([]byte, error) {
	if len(body) < 3 || body[0] != '{' || body[len(body)-1] != '}' {
		return nil, fmt.Errorf("shrink: seal %s: want a non-empty JSON object, got %q", key, body)
	}
	out := make([]byte, 0, len(body)-1+sealedTail)
	out = append(out, body[:len(body)-1]...)
	out = append(out, macField...)
	out = hex.AppendEncode(out, a.mac(key, body))
	return append(out, `"}`...), nil
}

// open verifies rec, read at key, and returns its body: the record
// without its mac field. A record that fails is reported (once) and
// refused with a Forgery.
func (a *Auth) open(key string, rec []byte) ([]byte, error) {
	body, reason := a.verify(key, rec)
	if reason == "" {
		return body, nil
	}
	f := Forgery{Key: key, Reason: reason}
	a.report(f, rec)
	return nil, f
}

// verify is open without the reporting: the body, or why rec is forged.
func (a *Auth) verify(key string, rec []byte) ([]byte, ForgeryReason) {
	n := len(rec)
	if n < sealedTail+2 || !bytes.HasSuffix(rec, []byte(`"}`)) || string(rec[n-sealedTail:n-sealedTail+len(macField)]) != macField {
		if bytes.Contains(rec, []byte(`"mac"`)) {
			return nil, Malformed
		}
		return nil, NoMAC
	}
	digits := rec[n-sealedTail+len(macField) : n-2]
	for _, c := range digits {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return nil, Malformed
		}
	}
	got := make([]byte, sha256.Size)
	if _, err := hex.Decode(got, digits); err != nil {
		return nil, Malformed
	}
	body := make([]byte, 0, n-sealedTail+1)
	body = append(append(body, rec[:n-sealedTail]...), '}')
	if !hmac.Equal(got, a.mac(key, body)) {
		return nil, BadMAC
	}
	return body, ""
}

// report counts and reports forgery f of record rec, unless that record
// at that key was reported already: a reader that polls a forged key sees
// it many times.
func (a *Auth) report(f Forgery, rec []byte) {
	h := sha256.New()
	h.Write([]byte(f.Key))
	h.Write([]byte{0})
	h.Write(rec)
	var d [sha256.Size]byte
	h.Sum(d[:0])
	a.mu.Lock()
	dup := a.seen[d]
	if !dup && len(a.seen) >= maxSeen {
		clear(a.seen) // an attacker's flood: report some again rather than grow without bound
	}
	a.seen[d] = true
	a.mu.Unlock()
	if dup {
		return
	}
	a.forged.Add(1)
	if a.onForged != nil {
		a.onForged(f)
	}
}
