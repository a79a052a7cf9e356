package main

import "github.com/urfave/cli/v2"

// urfave/cli's Names runs a regular expression over each spelling at every
// call, and its IsSet finds a flag by walking every flag's Names. Before
// each action it asks IsSet of every spelling of every flag: for gorun's
// hundred-odd spellings, some 30,000 runs of the expression, about 3 ms of
// CPU on every launch (and seconds of the CLI tests under the race
// detector). The wrappers below answer Names from a slice made once; all
// other methods are the flag's own.

type (
	stringFlag struct {
		*cli.StringFlag
		names []string
	}
	boolFlag struct {
		*cli.BoolFlag
		names []string
	}
	intFlag struct {
		*cli.IntFlag
		names []string
	}
	float64Flag struct {
		*cli.Float64Flag
		names []string
	}
	durationFlag struct {
		*cli.DurationFlag
		names []string
	}
)

func (f stringFlag) Names() []string   { return f.names }
func (f boolFlag) Names() []string     { return f.names }
func (f intFlag) Names() []string      { return f.names }
func (f float64Flag) Names() []string  { return f.names }
func (f durationFlag) Names() []string { return f.names }

// namedOnce wraps each flag of a kind gorun uses so that its Names is
// computed once; other kinds are left as they are.
func namedOnce(flags []cli.Flag) []cli.Flag {
	out := make([]cli.Flag, len(flags))
	for i, f := range flags {
		names := f.Names()
		switch f := f.(type) {
		case *cli.StringFlag:
			out[i] = stringFlag{f, names}
		case *cli.BoolFlag:
			out[i] = boolFlag{f, names}
		case *cli.IntFlag:
			out[i] = intFlag{f, names}
		case *cli.Float64Flag:
			out[i] = float64Flag{f, names}
		case *cli.DurationFlag:
			out[i] = durationFlag{f, names}
		default:
			out[i] = f
		}
	}
	return out
}
