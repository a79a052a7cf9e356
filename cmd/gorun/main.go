// Command gorun is a torchrun-style launcher and elastic job orchestrator.
// This file wires the command line; the work is done by the packages it
// calls.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/gorunhq/gorun/launcher"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = "dev"

func main() {
	if launcher.EtcdBackendLinked {
		os.Unsetenv(handOverEnv) // for the workers: see handOverToEtcdBuild
	}
	os.Exit(run(context.Background(), os.Args, os.Stdin, os.Stdout, os.Stderr))
}

// run is main without the process: tests call it with their own streams.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return runApp(ctx, newApp(stdin, stdout, stderr), args)
}

// runApp runs app on args (argv[0] first) and returns the exit code,
// reporting an error as one line on the app's error stream.
func runApp(ctx context.Context, app *cli.App, args []string) int {
	if len(args) > 1 && programAfterDashDash(app.Flags, args[1:]) {
		// `gorun -- store …` runs a program named store.
		app.Commands, app.HideHelpCommand = nil, true
	}
	app.Metadata = map[string]any{argvKey: args}
	err := app.RunContext(ctx, args)
	if err == nil {
		return ExitOK
	}
	err = explainUnknownFlag(err, func() []cli.Flag { return allFlags(app.Flags, app.Commands) })
	fmt.Fprintf(app.ErrWriter, "gorun: %v\n", err)
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	// Actions return *exitError (see action); anything else comes from
	// parsing the command line: a missing required flag, an unknown one.
	return ExitUsage
}

// action adapts a command's function so that every error it returns
// carries gorun's exit code for it.
func action(fn cli.ActionFunc) cli.ActionFunc {
	return func(c *cli.Context) error {
		err := fn(c)
		if err == nil {
			return nil
		}
		var ee *exitError
		if errors.As(err, &ee) {
			return err
		}
		return &exitError{code: exitCode(err), err: err}
	}
}

// onUsageError reports a flag the parser rejected as a usage error, without
// the help text urfave/cli would print otherwise.
func onUsageError(_ *cli.Context, err error, _ bool) error {
	return &exitError{code: ExitUsage, err: err}
}

// setUsageHandlers installs onUsageError on every command and subcommand;
// urfave/cli consults only the command's own handler.
func setUsageHandlers(cmds []*cli.Command) {
	for _, c := range cmds {
		c.OnUsageError = onUsageError
		setUsageHandlers(c.Subcommands)
	}
}

func newApp(stdin io.Reader, stdout, stderr io.Writer) *cli.App {
	app := &cli.App{
		Name:        "gorun",
		Usage:       "launch and supervise distributed PyTorch (and Go) jobs; a torchrun drop-in",
		UsageText:   launchUsage + "\ngorun store COMMAND [flags] [ARGS…]",
		Description: launchDescription,
		Version:     version,
		Reader:      stdin,
		Writer:      stdout,
		// Errors are printed once, by run, with a documented exit code.
		ErrWriter:      stderr,
		ExitErrHandler: func(*cli.Context, error) {},
		OnUsageError:   onUsageError,
		Flags: namedOnce(append([]cli.Flag{
			&cli.StringFlag{
				Name:    "log-level",
				Value:   "info",
				Usage:   "log level: debug, info, warn or error",
				EnvVars: []string{"GORUN_LOG_LEVEL"},
			},
			&cli.StringFlag{
				Name:    "log-format",
				Value:   "console",
				Usage:   "log format: console or json",
				EnvVars: []string{"GORUN_LOG_FORMAT"},
			},
		}, launchFlags()...)),
		// The root command is the launcher (launch.go).
		Action:   action(runLaunch),
		Commands: []*cli.Command{storeCommand()},
	}
	setUsageHandlers(app.Commands)
	return app
}

// newLogger builds the zap logger the global flags ask for, writing to the
// app's error stream.
func newLogger(c *cli.Context) (*zap.Logger, error) {
	var level zapcore.Level
	if err := level.Set(c.String("log-level")); err != nil {
		return nil, usageErrorf("--log-level: %v", err)
	}
	encCfg := zap.NewProductionEncoderConfig()
	encCfg.EncodeTime = zapcore.ISO8601TimeEncoder
	var enc zapcore.Encoder
	switch c.String("log-format") {
	case "console":
		encCfg.EncodeLevel = zapcore.CapitalLevelEncoder
		enc = zapcore.NewConsoleEncoder(encCfg)
	case "json":
		enc = zapcore.NewJSONEncoder(encCfg)
	default:
		return nil, usageErrorf("--log-format: %q is neither console nor json", c.String("log-format"))
	}
	core := zapcore.NewCore(enc, zapcore.AddSync(c.App.ErrWriter), level)
	// Sampling keeps a flood of bad clients from flooding the log.
	core = zapcore.NewSamplerWithOptions(core, time.Second, 10, 100)
	return zap.New(core).Named(filepath.Base(c.App.Name)), nil
}
