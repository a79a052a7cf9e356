package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
)

// torchScripts are what the torch worker kind runs: the training script and
// the helper it imports, from examples/torch.
var torchScripts = []string{"train_elastic.py", "gorun_ft.py"}

// stageTorch copies the torch worker's scripts from the repository at root
// into dir and returns train_elastic.py's path there. A copy, not the
// repository's file: torchrun 2.14 and its workers run in the sid bed,
// which sees the temporary directory at the same path and nothing of the
// repository.
func stageTorch(root, dir string) (string, error) {
	for _, name := range torchScripts {
		b, err := os.ReadFile(filepath.Join(root, "examples", "torch", name))
		if err != nil {
			return "", fmt.Errorf("stage the torch worker: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return "", fmt.Errorf("stage the torch worker: %w", err)
		}
	}
	return filepath.Join(dir, torchScripts[0]), nil
}

// referenceProgram computes, in one process and without a process group,
// the loss train_elastic.py ends with after a fault-free run: every step,
// the gradients of launch ranks 0..world-1 on their own batches (its batch
// function, so the same samples), summed and divided by world. argv:
// script steps world lr.
const referenceProgram = `
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import torch
import train_elastic as te
steps, world, lr = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
w = torch.zeros(te.DIM, dtype=torch.float64)
for s in range(steps):
    grad = torch.zeros(te.DIM, dtype=torch.float64)
    for r in range(world):
        x, y = te.batch(r, s)
        grad += 2 * x.t() @ (x @ w - y) / len(x)
    w -= lr * grad / world
print(repr(te.eval_loss(w)))
`

// referenceLoss runs referenceProgram with python: the loss a fault-free
// run of steps steps at world ranks must end with (see exactness).
func referenceLoss(ctx context.Context, python, script string, steps, world int, lr string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, python, "-c", referenceProgram, script, strconv.Itoa(steps), strconv.Itoa(world), lr)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return 0, fmt.Errorf("reference loss: %w\n%s", err, ee.Stderr)
		}
		return 0, fmt.Errorf("reference loss: %w", err)
	}
	loss, err := strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
	if err != nil {
		return 0, fmt.Errorf("reference loss: %q: %w", out, err)
	}
	return loss, nil
}

// resolvePython214 is -python214's interpreter: "auto" the sid bed's when
// it is built and we are root (its enter script needs a mount namespace
// and chroot), "" none; a path as given. why says why there is none.
func resolvePython214(choice string) (python, why string) {
	if choice == "" {
		return "", "-python214 is empty"
	}
	if choice != "auto" {
		return choice, ""
	}
	bed, err := sidbed.Find()
	if err != nil {
		return "", err.Error()
	}
	if os.Geteuid() != 0 {
		return "", "the sid bed at " + bed.Dir + " is entered as root only"
	}
	return bed.Python(), ""
}
