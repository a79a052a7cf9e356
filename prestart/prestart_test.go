package prestart

import (
	"bytes"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestReadWrite(t *testing.T) {
	tests := []struct {
		name    string
		wire    string
		want    map[string]string
		wantErr error
		errText string
	}{
		{name: "assignment", wire: `{"env":{"RANK":"2","WORLD_SIZE":"4"}}` + "\n", want: map[string]string{"RANK": "2", "WORLD_SIZE": "4"}},
		{name: "agent gone", wire: "", wantErr: ErrNoAssignment},
		{name: "garbage", wire: "RANK=2\n", errText: "invalid character"},
		{name: "too large", wire: `{"env":{"X":"` + strings.Repeat("x", maxAssignment) + `"}}`, errText: "over"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, err := Read(strings.NewReader(tt.wire))
			switch {
			case tt.wantErr != nil || tt.errText != "":
				if err == nil || (tt.wantErr != nil && !errors.Is(err, tt.wantErr)) || !strings.Contains(err.Error(), tt.errText) {
					t.Fatalf("Read: %v, want %v %q", err, tt.wantErr, tt.errText)
				}
			case err != nil:
				t.Fatal(err)
			case len(a.Env) != len(tt.want):
				t.Fatalf("Read: %v, want %v", a.Env, tt.want)
			default:
				for k, v := range tt.want {
					if a.Env[k] != v {
						t.Errorf("%s=%q, want %q", k, a.Env[k], v)
					}
				}
			}
		})
	}
	var buf bytes.Buffer
	if err := Write(&buf, Assignment{Env: map[string]string{"RANK": "7"}}); err != nil {
		t.Fatal(err)
	}
	if a, err := Read(&buf); err != nil || a.Env["RANK"] != "7" {
		t.Fatalf("round trip: %v, %v", a, err)
	}
}

// TestAwait: a parked process blocks until the agent writes its
// assignment on the inherited pipe, then has it in its environment, and
// its children are not parked.
func TestAwait(t *testing.T) {
	t.Run("not parked", func(t *testing.T) {
		os.Unsetenv(EnvFD)
		if parked, err := Await(); parked || err != nil {
			t.Fatalf("Await = %v, %v; want false, nil", parked, err)
		}
	})
	t.Run("assigned", func(t *testing.T) {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		t.Setenv(EnvFD, strconv.Itoa(int(r.Fd())))
		t.Setenv("PRESTART_TEST_RANK", "parked")
		type result struct {
			parked bool
			err    error
		}
		done := make(chan result, 1)
		go func() {
			parked, err := Await()
			done <- result{parked, err}
		}()
		select {
		case r := <-done:
			t.Fatalf("Await returned %v before the assignment", r)
		case <-time.After(100 * time.Millisecond):
		}
		if err := Write(w, Assignment{Env: map[string]string{"PRESTART_TEST_RANK": "3"}}); err != nil {
			t.Fatal(err)
		}
		w.Close()
		select {
		case res := <-done:
			if !res.parked || res.err != nil {
				t.Fatalf("Await = %v, %v", res.parked, res.err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Await did not return after the assignment")
		}
		if v := os.Getenv("PRESTART_TEST_RANK"); v != "3" {
			t.Errorf("PRESTART_TEST_RANK=%q after Await, want 3", v)
		}
		if _, set := os.LookupEnv(EnvFD); set {
			t.Errorf("%s still set after Await", EnvFD)
		}
	})
	t.Run("agent gone", func(t *testing.T) {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		t.Setenv(EnvFD, strconv.Itoa(int(r.Fd())))
		w.Close()
		if parked, err := Await(); !parked || !errors.Is(err, ErrNoAssignment) {
			t.Fatalf("Await = %v, %v; want true, ErrNoAssignment", parked, err)
		}
	})
	t.Run("bad descriptor", func(t *testing.T) {
		t.Setenv(EnvFD, "three")
		if _, err := Await(); err == nil || !strings.Contains(err.Error(), "not a file descriptor") {
			t.Fatalf("Await: %v", err)
		}
	})
}
