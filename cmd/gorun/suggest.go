package main

import (
	"fmt"
	"strings"

	"github.com/gorunhq/gorun/internal/suggest"
	"github.com/urfave/cli/v2"
)

// undefinedFlagPrefix starts the error the flag parser gives for a flag it
// does not know ("flag provided but not defined: -nproc-per-nod").
const undefinedFlagPrefix = "flag provided but not defined: -"

// explainUnknownFlag rewrites the parser's error for an unknown flag as
// "unknown flag --NAME", with the nearest known flag when one is close
// (torchrun's argparse names the flag and suggests too); flags lists the
// known ones, asked for only then. Other errors pass through.
func explainUnknownFlag(err error, flags func() []cli.Flag) error {
	name, ok := strings.CutPrefix(err.Error(), undefinedFlagPrefix)
	if !ok {
		return err
	}
	name = strings.TrimLeft(name, "-")
	if best := nearestFlag(name, flags()); best != "" {
		return fmt.Errorf("unknown flag --%s (did you mean --%s?)", name, best)
	}
	return fmt.Errorf("unknown flag --%s (gorun --help lists them)", name)
}

// nearestFlag returns the known flag name closest to name ("_" and "-"
// alike, as gorun takes both), or "".
func nearestFlag(name string, flags []cli.Flag) string {
	var names []string
	for _, f := range flags {
		for _, n := range f.Names() {
			if len(n) > 1 { // -m and the like suggest nothing useful
				names = append(names, n)
			}
		}
	}
	canon := func(s string) string { return strings.ReplaceAll(s, "_", "-") }
	canonNames := make([]string, len(names))
	for i, n := range names {
		canonNames[i] = canon(n)
	}
	best := suggest.Nearest(canon(name), canonNames)
	for i, c := range canonNames {
		if c == best && best != "" {
			return names[i]
		}
	}
	return ""
}

// allFlags returns flags and those of every command under cmds: the error
// does not say which command's parser refused the flag. Each command is
// visited once: urfave/cli gives commands a help subcommand that can lead
// back to itself.
func allFlags(flags []cli.Flag, cmds []*cli.Command) []cli.Flag {
	all := append([]cli.Flag(nil), flags...)
	seen := map[*cli.Command]bool{}
	var walk func([]*cli.Command)
	walk = func(cs []*cli.Command) {
		for _, c := range cs {
			if c == nil || seen[c] {
				continue
			}
			seen[c] = true
			all = append(all, c.Flags...)
			walk(c.Subcommands)
		}
	}
	walk(cmds)
	return all
}
