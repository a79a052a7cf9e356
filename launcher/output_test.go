package launcher

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestHeldOutput: a standby's lines are held until it takes a slot, then
// go where the slot's do, in order, the held ones first and after its
// predecessor's in the slot's log; what it held is told (heldTail) and
// bounded, the oldest let go first.
func TestHeldOutput(t *testing.T) {
	var stdout, stderr bytes.Buffer
	con := &console{stdout: &stdout, stderr: &stderr}
	o, ends, err := openHeldOutput(con)
	if err != nil {
		t.Fatal(err)
	}
	ends[0].WriteString("parked 1\nparked 2\n")
	ends[1].WriteString("importing\n")
	waitHeld(t, o, 0, "parked 1\nparked 2")
	waitHeld(t, o, 1, "importing")
	if stdout.Len()+stderr.Len() > 0 {
		t.Fatalf("held lines reached the console: %q %q", stdout.String(), stderr.String())
	}

	dir := t.TempDir()
	log := filepath.Join(dir, "stdout.log")
	if err := os.WriteFile(log, []byte("the rank's first worker\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	o.setPrefix("[default2]:")
	plans := [2]streamPlan{
		{stream: StdOut, toFile: log, appendFile: true, toConsole: true},
		{stream: StdErr, toConsole: true},
	}
	if err := o.route(plans); err != nil {
		t.Fatal(err)
	}
	ends[0].WriteString("assigned\n")
	ends[0].Close()
	ends[1].Close()
	o.drain(outputDrainTimeout)
	if got, want := stdout.String(), "[default2]:parked 1\n[default2]:parked 2\n[default2]:assigned\n"; got != want {
		t.Errorf("console stdout %q, want %q", got, want)
	}
	if got, want := stderr.String(), "[default2]:importing\n"; got != want {
		t.Errorf("console stderr %q, want %q", got, want)
	}
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(b), "the rank's first worker\nparked 1\nparked 2\nassigned\n"; got != want {
		t.Errorf("the slot's log holds %q, want %q", got, want)
	}

	// Bounded: a standby that writes more than it may hold keeps the
	// latest lines.
	o, ends, err = openHeldOutput(con)
	if err != nil {
		t.Fatal(err)
	}
	line := strings.Repeat("x", 1023) + "\n"
	for range maxHeldOutput/len(line) + 10 {
		ends[1].WriteString(line)
	}
	ends[1].WriteString("the last words\n")
	ends[0].Close()
	ends[1].Close()
	o.drain(outputDrainTimeout)
	tail, dropped := o.heldTail(1, 100)
	if tail != "the last words" || dropped < 10 {
		t.Errorf("heldTail = %q, %d dropped; want the last line and at least 10 dropped", tail, dropped)
	}
	st := o.streams[1]
	if st.heldBytes > maxHeldOutput {
		t.Errorf("holds %d bytes, want at most %d", st.heldBytes, maxHeldOutput)
	}
}

// waitHeld waits until stream i of o holds want (its lines, joined).
func waitHeld(t *testing.T, o *workerOutput, i int, want string) {
	t.Helper()
	for range 2000 {
		if got, _ := o.heldTail(i, 1<<20); got == want {
			return
		}
		time.Sleep(time.Millisecond)
	}
	got, _ := o.heldTail(i, 1<<20)
	t.Fatalf("stream %d holds %q, want %q", i, got, want)
}
