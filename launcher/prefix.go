package launcher

import (
	"strconv"
	"strings"
)

// defaultLinePrefix is torchrun's console prefix of a worker's lines.
const defaultLinePrefix = "[${role_name}${local_rank}]:"

// linePrefix is the console prefix of worker as's lines: the template
// (--log-line-prefix-template, else torchrun's default) with its names
// filled in.
func (a *agent) linePrefix(as Assignment) string {
	tmpl := a.cfg.LogLinePrefixTemplate
	if tmpl == "" {
		tmpl = defaultLinePrefix
	}
	rank := "?" // a parked worker's, before its round
	if as.Rank >= 0 {
		rank = strconv.Itoa(as.Rank)
	}
	return expandTemplate(tmpl, map[string]string{
		"role_name":  a.cfg.Role,
		"local_rank": strconv.Itoa(as.LocalRank),
		"rank":       rank,
		"hostname":   a.host,
	})
}

// expandTemplate fills in a Python string.Template the way its
// safe_substitute does: "$name" and "${name}" become vars[name] when name
// is there, and stay as written when it is not; "$$" is "$"; any other "$"
// is kept.
func expandTemplate(tmpl string, vars map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(tmpl); i++ {
		c := tmpl[i]
		if c != '$' || i+1 == len(tmpl) {
			b.WriteByte(c)
			continue
		}
		rest := tmpl[i+1:]
		switch {
		case rest[0] == '$':
			b.WriteByte('$')
			i++
		case rest[0] == '{':
			end := strings.IndexByte(rest, '}')
			name := ""
			if end > 0 {
				name = rest[1:end]
			}
			if v, ok := vars[name]; ok && isIdentifier(name) {
				b.WriteString(v)
				i += end + 1
			} else {
				b.WriteByte('$')
			}
		default:
			n := identifierLen(rest)
			if v, ok := vars[rest[:n]]; ok && n > 0 {
				b.WriteString(v)
				i += n
			} else {
				b.WriteByte('$')
			}
		}
	}
	return b.String()
}

// identifierLen is the length of the Python identifier s starts with (an
// ASCII letter or '_', then letters, digits, '_').
func identifierLen(s string) int {
	for i := 0; i < len(s); i++ {
		c := s[i]
		letter := c == '_' || (c|0x20 >= 'a' && c|0x20 <= 'z')
		if !letter && (i == 0 || c < '0' || c > '9') {
			return i
		}
	}
	return len(s)
}

func isIdentifier(s string) bool { return s != "" && identifierLen(s) == len(s) }
