// Command sidbed builds or checks gorun's Debian sid test bed
// (internal/sidbed).
//
//	sidbed build   build the bed unless a current one is cached (root)
//	sidbed check   say whether a bed is there and what it holds; with -run,
//	               also import torch.distributed inside it
//
// `make test-deps` runs `sidbed build` when it is root on Debian.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/gorunhq/gorun/internal/sidbed"
)

func main() {
	fs := flag.NewFlagSet("sidbed", flag.ExitOnError)
	verbose := fs.Bool("v", false, "show debootstrap's and apt's output")
	runPy := fs.Bool("run", false, "check: also run the bed's python and import torch.distributed")
	timeout := fs.Duration("timeout", 20*time.Minute, "give up after this long")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: sidbed [-v] [-run] [-timeout D] build|check")
		fs.PrintDefaults()
	}
	if len(os.Args) < 2 {
		fs.Usage()
		os.Exit(2)
	}
	verb := os.Args[1]
	_ = fs.Parse(os.Args[2:])
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()

	start := time.Now()
	var bed *sidbed.Bed
	var err error
	switch verb {
	case "build":
		var log io.Writer = io.Discard
		if *verbose {
			log = os.Stderr
		}
		bed, err = sidbed.Build(ctx, sidbed.Config{Log: log})
	case "check":
		bed, err = sidbed.Find()
		if err == nil && *runPy {
			var out []byte
			out, err = bed.Command(ctx, "/usr/bin/python3", "-c", "import torch, torch.distributed; print(torch.__version__)").Output()
			if err == nil && len(out) == 0 {
				err = fmt.Errorf("python printed nothing")
			}
		}
	default:
		fs.Usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "sidbed %s: %v\n", verb, err)
		os.Exit(1)
	}
	s := bed.Stamp
	fmt.Printf("sidbed: %s: torch %s (python3-torch %s), nccl %s (libnccl2 %s); built %s in %.0f s; %s took %.1f s\n",
		bed.Dir, s.Torch, s.Packages["python3-torch"], s.NCCL, s.Packages["libnccl2"],
		s.Built.Format(time.RFC3339), float64(s.BuildMS)/1000, verb, time.Since(start).Seconds())
}
