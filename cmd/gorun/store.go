package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/gorunhq/gorun/rendezvous"
	"github.com/gorunhq/gorun/rendezvous/filestore"
	"github.com/gorunhq/gorun/rendezvous/tcpstore"
)

// storeCommand is `gorun store`: a c10d store server and a client for
// poking at any c10d store (ours, PyTorch's, a FileStore).
func storeCommand() *cli.Command {
	clientFlags := []cli.Flag{
		&cli.StringFlag{
			Name:     "store",
			Usage:    "store `URL`: tcp://HOST:PORT or file:///PATH",
			EnvVars:  []string{"GORUN_STORE"},
			Required: true,
		},
		&cli.DurationFlag{
			Name:    "timeout",
			Value:   30 * time.Second,
			Usage:   "give up connecting or waiting for keys after this long",
			EnvVars: []string{"GORUN_STORE_TIMEOUT"},
		},
		&cli.StringFlag{
			Name:    "wire",
			Value:   "new",
			Usage:   "TCPStore wire generation: new (PyTorch ≥2.1) or old (PyTorch 1.13–2.0)",
			EnvVars: []string{"GORUN_STORE_WIRE"},
		},
		&cli.StringFlag{
			Name:    "prefix",
			Usage:   "read and write keys under `P`/ (c10d's PrefixStore), e.g. /worker/attempt_0",
			EnvVars: []string{"GORUN_STORE_PREFIX"},
		},
	}
	verb := func(name, args, usage string, minArgs, maxArgs int, fn verbFunc) *cli.Command {
		return &cli.Command{
			Name:      name,
			Usage:     usage,
			ArgsUsage: args,
			Flags:     namedOnce(clientFlags),
			Action: action(func(c *cli.Context) error {
				n := c.NArg()
				if n < minArgs || (maxArgs >= 0 && n > maxArgs) {
					return usageErrorf("store %s: want arguments %s, got %d", name, args, n)
				}
				return runVerb(c, fn)
			}),
		}
	}
	return &cli.Command{
		Name:  "store",
		Usage: "serve a c10d-compatible TCPStore, or read and write any c10d store",
		Subcommands: []*cli.Command{
			serveCommand(),
			verb("get", "KEY", "write KEY's value to stdout (waits for the key)", 1, 1, verbGet),
			verb("set", "KEY [VALUE]", "set KEY to VALUE (or to stdin)", 1, 2, verbSet),
			verb("add", "KEY DELTA", "add DELTA to the counter KEY and print the result", 2, 2, verbAdd),
			verb("cas", "KEY EXPECTED DESIRED", "compare-and-set; print the value the store returns", 3, 3, verbCAS),
			verb("wait", "KEY...", "wait until every KEY exists", 1, -1, verbWait),
			verb("check", "KEY...", "print true and exit 0 if every KEY exists, else print false and exit 1", 1, -1, verbCheck),
			verb("delete", "KEY", "delete KEY; print whether it existed", 1, 1, verbDelete),
			verb("keys", "", "print every key, one per line", 0, 0, verbKeys),
			verb("num-keys", "", "print the number of keys (c10d counts internal keys such as init/)", 0, 0, verbNumKeys),
		},
	}
}

func serveCommand() *cli.Command {
	lim := tcpstore.DefaultLimits()
	return &cli.Command{
		Name:  "serve",
		Usage: "serve a c10d TCPStore (both wire generations) until SIGTERM or SIGINT",
		Description: "Prints the address it listens on as the first line of stdout (useful with port 0).\n" +
			"PyTorch workers use it as MASTER_ADDR:MASTER_PORT; with TORCHELASTIC_USE_AGENT_STORE=True\n" +
			"they all connect as clients.",
		Flags: []cli.Flag{
			&cli.StringFlag{
				Name:    "listen",
				Value:   ":29500",
				Usage:   "`HOST:PORT` to listen on; port 0 picks a free port; an empty host means every address",
				EnvVars: []string{"GORUN_STORE_LISTEN"},
			},
			&cli.StringFlag{
				Name:    "max-key-size",
				Value:   formatSize(lim.MaxKeySize),
				Usage:   "largest key a client may send (bytes, or with KiB/MiB/GiB)",
				EnvVars: []string{"GORUN_STORE_MAX_KEY_SIZE"},
			},
			&cli.StringFlag{
				Name:    "max-value-size",
				Value:   formatSize(lim.MaxValueSize),
				Usage:   "largest value a client may send",
				EnvVars: []string{"GORUN_STORE_MAX_VALUE_SIZE"},
			},
			&cli.IntFlag{
				Name:    "max-key-count",
				Value:   lim.MaxKeyCount,
				Usage:   "most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET",
				EnvVars: []string{"GORUN_STORE_MAX_KEY_COUNT"},
			},
			&cli.StringFlag{
				Name:        "max-request-size",
				Usage:       "largest request as a whole; never less than a COMPARE_SET of the largest key and two of the largest values",
				DefaultText: "that minimum",
				EnvVars:     []string{"GORUN_STORE_MAX_REQUEST_SIZE"},
			},
			&cli.StringFlag{
				Name:  "max-buffered",
				Value: formatSize(int(tcpstore.DefaultMaxBuffered)),
				Usage: "memory all connections together may hold in requests still arriving; " +
					"a connection whose bytes would pass it is closed (buffers grow only as bytes arrive)",
				EnvVars: []string{"GORUN_STORE_MAX_BUFFERED"},
			},
			&cli.StringFlag{
				Name:  "max-stored",
				Value: "none",
				Usage: "most bytes of keys and values the store holds (none: no limit, as PyTorch's server); " +
					"a write past it is refused (the connection closed)",
				EnvVars: []string{"GORUN_STORE_MAX_STORED"},
			},
			&cli.StringFlag{
				Name:    "legacy-table",
				Value:   "1.13",
				Usage:   "opcode table for clients that skip VALIDATE: 1.13 (PyTorch 1.13–2.0) or 2.1",
				EnvVars: []string{"GORUN_STORE_LEGACY_TABLE"},
			},
		},
		Action: action(runServe),
	}
}

func runServe(c *cli.Context) error {
	if c.NArg() > 0 {
		return usageErrorf("store serve takes no arguments, got %q", c.Args().Slice())
	}
	log, err := newLogger(c)
	if err != nil {
		return err
	}
	defer log.Sync()
	cfg := tcpstore.ServerConfig{Logger: log}
	var maxBuffered int
	for _, f := range []struct {
		flag string
		dst  *int
	}{
		{"max-key-size", &cfg.Limits.MaxKeySize},
		{"max-value-size", &cfg.Limits.MaxValueSize},
		{"max-request-size", &cfg.Limits.MaxRequestSize},
		{"max-buffered", &maxBuffered},
	} {
		if !c.IsSet(f.flag) && c.String(f.flag) == "" {
			continue // the library's default
		}
		if *f.dst, err = parseSize(c.String(f.flag)); err != nil {
			return usageErrorf("--%s: %v", f.flag, err)
		}
	}
	cfg.MaxBuffered = int64(maxBuffered)
	if v := c.String("max-stored"); v != "none" {
		n, err := parseSize(v)
		if err != nil {
			return usageErrorf("--max-stored: %v (or none)", err)
		}
		cfg.MaxStored = int64(n)
	}
	if cfg.Limits.MaxKeyCount = c.Int("max-key-count"); cfg.Limits.MaxKeyCount <= 0 {
		return usageErrorf("--max-key-count must be positive, got %d", cfg.Limits.MaxKeyCount)
	}
	switch c.String("legacy-table") {
	case "1.13":
		cfg.LegacyTable = tcpstore.Legacy113
	case "2.1":
		cfg.LegacyTable = tcpstore.Legacy21
	default:
		return usageErrorf("--legacy-table: %q is neither 1.13 nor 2.1", c.String("legacy-table"))
	}

	ctx, stop := signal.NotifyContext(c.Context, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	srv, err := tcpstore.Listen(c.String("listen"), cfg)
	if err != nil {
		return &exitError{code: ExitUnavailable, err: fmt.Errorf("store serve: %w", err)}
	}
	fmt.Fprintln(c.App.Writer, srv.Addr())
	log.Info("store serving", zap.Stringer("addr", srv.Addr()))
	<-ctx.Done()
	log.Info("store stopping", zap.Int64("open_connections", srv.Stats().Open))
	return srv.Close()
}

// verbFunc is one client verb, run against an open store.
type verbFunc func(ctx context.Context, c *cli.Context, s rendezvous.Store) error

func runVerb(c *cli.Context, fn verbFunc) error {
	timeout := c.Duration("timeout")
	if timeout <= 0 {
		return usageErrorf("--timeout must be positive, got %v", timeout)
	}
	ctx, cancel := context.WithTimeout(c.Context, timeout)
	defer cancel()
	ctx, stopped := onStopSignal(ctx)
	err := runVerbIn(ctx, c, timeout, fn)
	if sig := stopped(); sig != 0 && err != nil {
		// Not a timeout, whatever the store's error says: README, 128+N.
		return &exitError{code: ExitSignalBase + int(sig), err: fmt.Errorf("stopped by %s: %w", unix.SignalName(sig), err)}
	}
	return err
}

// onStopSignal returns ctx, cancelled also by SIGTERM or SIGINT, and a
// function that stops listening and returns the signal that cancelled it
// (0 if none).
func onStopSignal(ctx context.Context) (context.Context, func() syscall.Signal) {
	ctx, cancel := context.WithCancel(ctx)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	done := make(chan struct{})
	var got syscall.Signal
	go func() {
		defer close(done)
		select {
		case s := <-sigs:
			got, _ = s.(syscall.Signal)
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, func() syscall.Signal {
		signal.Stop(sigs)
		cancel()
		<-done
		return got
	}
}

// runVerbIn opens the store and runs fn on it within ctx.
func runVerbIn(ctx context.Context, c *cli.Context, timeout time.Duration, fn verbFunc) error {
	s, err := openStore(ctx, c.String("store"), c.String("wire"), timeout)
	if err != nil {
		return err
	}
	defer s.Close()
	if p := c.String("prefix"); p != "" {
		s = rendezvous.NewPrefixStore(p, s)
	}
	err = fn(ctx, c, s)
	if errors.Is(err, tcpstore.ErrHungUp) && storeAnswers(c.Context, c.String("store"), c.String("wire")) {
		return &exitError{code: ExitStoreError, err: fmt.Errorf("the store refused the request: %w, "+
			"and it still answers; a c10d server refuses by closing the connection "+
			"(a key or value over its limits, a full store or buffer, a counter that is not an integer: "+
			"the server's log says which)", err)}
	}
	return err
}

// storeAnswers tells a store that refused a request (it closed the
// connection on it, the only refusal c10d's wire has) from one that went
// away: it reports whether the TCPStore at raw answers a GETNUMKEYS on a
// fresh connection within a few seconds. A refused connection fails it at
// once.
func storeAnswers(ctx context.Context, raw, wire string) bool {
	const probeTimeout = 5 * time.Second
	u, err := url.Parse(raw)
	if err != nil {
		return false
	}
	nc, err := net.DialTimeout("tcp", u.Host, probeTimeout)
	if err != nil {
		return false
	}
	nc.Close()
	gen, err := tcpstore.ParseGeneration(wire)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	s, err := tcpstore.Dial(ctx, u.Host, tcpstore.ClientConfig{Wire: gen, Timeout: probeTimeout})
	if err != nil {
		return false
	}
	defer s.Close()
	_, err = s.NumKeys(ctx)
	return err == nil
}

// openStore opens a store URL for the client verbs.
func openStore(ctx context.Context, raw, wire string, timeout time.Duration) (rendezvous.Store, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, usageErrorf("--store %q: %v", raw, err)
	}
	switch u.Scheme {
	case "tcp":
		if u.Port() == "" || u.Hostname() == "" || (u.Path != "" && u.Path != "/") {
			return nil, usageErrorf("--store %q: want tcp://HOST:PORT", raw)
		}
		gen, err := tcpstore.ParseGeneration(wire)
		if err != nil {
			return nil, usageErrorf("--wire: %v", err)
		}
		// A c10d server refuses a write only by closing the connection,
		// and SET has no reply: confirm every write, or a refused one
		// would exit 0.
		return tcpstore.Dial(ctx, u.Host, tcpstore.ClientConfig{Wire: gen, Timeout: timeout, ConfirmWrites: true})
	case "file":
		if u.Host != "" || u.Path == "" {
			return nil, usageErrorf("--store %q: want file:///ABSOLUTE/PATH", raw)
		}
		cfg := filestore.DefaultConfig()
		cfg.Timeout = timeout
		// An inspection tool must not change the file's bookkeeping.
		cfg.Cleanup = filestore.CleanupNone
		return filestore.Open(ctx, u.Path, cfg)
	}
	return nil, usageErrorf("--store %q: unsupported scheme; want tcp://HOST:PORT or file:///PATH", raw)
}

func verbGet(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	v, err := s.Get(ctx, c.Args().Get(0))
	if err != nil {
		return err
	}
	_, err = c.App.Writer.Write(v)
	return err
}

func verbSet(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	var v []byte
	if c.NArg() == 2 {
		v = []byte(c.Args().Get(1))
	} else {
		var err error
		if v, err = io.ReadAll(c.App.Reader); err != nil {
			return fmt.Errorf("reading the value from stdin: %w", err)
		}
	}
	return s.Set(ctx, c.Args().Get(0), v)
}

func verbAdd(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	delta, err := strconv.ParseInt(c.Args().Get(1), 10, 64)
	if err != nil {
		return usageErrorf("store add: DELTA %q is not an int64", c.Args().Get(1))
	}
	n, err := s.Add(ctx, c.Args().Get(0), delta)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(c.App.Writer, n)
	return err
}

func verbCAS(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	v, err := s.CompareSet(ctx, c.Args().Get(0), []byte(c.Args().Get(1)), []byte(c.Args().Get(2)))
	if err != nil {
		return err
	}
	_, err = c.App.Writer.Write(v)
	return err
}

func verbWait(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	return s.Wait(ctx, c.Args().Slice()...)
}

func verbCheck(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	ok, err := s.Check(ctx, c.Args().Slice()...)
	if err != nil {
		return err
	}
	fmt.Fprintln(c.App.Writer, ok)
	if !ok {
		return &exitError{code: ExitFalse, err: fmt.Errorf("not every key exists: %q", c.Args().Slice())}
	}
	return nil
}

func verbDelete(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	ok, err := s.Delete(ctx, c.Args().Get(0))
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(c.App.Writer, ok)
	return err
}

func verbKeys(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	keys, err := s.ListKeys(ctx)
	if err != nil {
		return err
	}
	for _, k := range keys {
		if _, err := fmt.Fprintln(c.App.Writer, k); err != nil {
			return err
		}
	}
	return nil
}

func verbNumKeys(ctx context.Context, c *cli.Context, s rendezvous.Store) error {
	n, err := s.NumKeys(ctx)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(c.App.Writer, n)
	return err
}

// parseSize reads a byte count: "8192", "8KiB", "8MiB", "1GiB".
func parseSize(s string) (int, error) {
	units := []struct {
		suffix string
		mult   int
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}}
	mult := 1
	num := strings.TrimSpace(s)
	for _, u := range units {
		if strings.HasSuffix(num, u.suffix) {
			num, mult = strings.TrimSpace(strings.TrimSuffix(num, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.Atoi(num)
	if err != nil || n <= 0 || n > (1<<40)/mult {
		return 0, fmt.Errorf("%q is not a positive size (bytes, or with KiB, MiB, GiB)", s)
	}
	return n * mult, nil
}

// formatSize is parseSize's inverse for flag defaults.
func formatSize(n int) string {
	switch {
	case n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return strconv.Itoa(n)
}
