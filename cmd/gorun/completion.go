package main

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"
)

// completionShells are the shells --print-completion writes for (torchrun
// 2.14's, through shtab, which gorun does without).
var completionShells = []string{"bash", "zsh", "tcsh"}

// printCompletion writes a completion script for shell to w: gorun's flags
// (every spelling), its commands, and file names for the program and its
// arguments.
func printCompletion(w io.Writer, shell string, app *cli.App) error {
	var flags []string
	for _, f := range app.Flags {
		for _, n := range f.Names() {
			if len(n) == 1 {
				flags = append(flags, "-"+n)
			} else {
				flags = append(flags, "--"+n)
			}
		}
	}
	slices.Sort(flags)
	var cmds []string
	for _, c := range app.Commands {
		cmds = append(cmds, c.Name)
	}
	words := strings.Join(flags, " ")
	switch shell {
	case "bash":
		_, err := fmt.Fprintf(w, `# bash completion for gorun (gorun --print-completion bash)
_gorun() {
    local cur=${COMP_WORDS[COMP_CWORD]}
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W %q -- "$cur"))
    elif [[ $COMP_CWORD -eq 1 ]]; then
        COMPREPLY=($(compgen -W %q -- "$cur") $(compgen -f -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}
complete -o filenames -F _gorun gorun
`, words, strings.Join(cmds, " "))
		return err
	case "zsh":
		_, err := fmt.Fprintf(w, `#compdef gorun
# zsh completion for gorun (gorun --print-completion zsh)
_gorun() {
    if [[ $PREFIX == -* ]]; then
        compadd -- %s
    else
        _files
    fi
}
compdef _gorun gorun
`, words)
		return err
	case "tcsh":
		_, err := fmt.Fprintf(w, "# tcsh completion for gorun (gorun --print-completion tcsh)\ncomplete gorun 'c/-/(%s)/' 'p/*/f/'\n",
			strings.ReplaceAll(strings.Join(flags, " "), "-", "\\-"))
		return err
	}
	return usageErrorf("--print-completion %q: want one of %s", shell, strings.Join(completionShells, ", "))
}
