package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/health"
)

// stepDone is what follows a successful step: a heartbeat to the agent
// (when it asks for them), the progress line, and on the group's rank 0
// the checkpoint. Every rank prints progress, not only rank 0: a rank 0
// killed between its step and its line would otherwise leave a step the
// survivors did unrecorded (a reader counts rank 0's lines, and another
// rank's for a step rank 0 has none of).
func (w *worker) stepDone(step int) error {
	// A beat that cannot be sent is the agent's concern (it will call the
	// rank hung); the step itself succeeded.
	_ = health.Beat()
	if w.opt.progress {
		fmt.Fprintln(w.out, progressLine(w.attempt, w.epoch.Number, step, w.group.Rank(), w.group.Size(), time.Now()))
	}
	if w.group.Rank() == 0 && w.opt.checkpoint != "" && ((step+1)%w.opt.checkpointEvery == 0 || step+1 == w.opt.steps) {
		if err := writeCheckpoint(w.opt.checkpoint, step+1); err != nil {
			return err
		}
	}
	return nil
}

// progressLine is what a rank prints with --progress after step (from 0),
// as rank of a group of world ranks, at time t.
func progressLine(attempt, epoch, step, rank, world int, t time.Time) string {
	return fmt.Sprintf("progress attempt=%d epoch=%d step=%d rank=%d world=%d unix_ns=%d", attempt, epoch, step, rank, world, t.UnixNano())
}

// writeCheckpoint records that steps steps are done. The file is replaced
// by a rename, so that a rank killed while writing leaves the previous
// checkpoint whole.
func writeCheckpoint(path string, steps int) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp-")
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	_, err = tmp.WriteString(strconv.Itoa(steps) + "\n")
	err = errors.Join(err, tmp.Close())
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// readCheckpoint returns the step to start from: the steps a checkpoint
// records, or 0 with no checkpoint (path "" or no file yet). A checkpoint
// beyond the run's steps is an error: it belongs to another run.
func readCheckpoint(path string, steps int) (int, error) {
	if path == "" {
		return 0, nil
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("checkpoint: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < 0 || n > steps {
		return 0, fmt.Errorf("checkpoint %s: %q is not a step count of 0..%d", path, strings.TrimSpace(string(b)), steps)
	}
	return n, nil
}
