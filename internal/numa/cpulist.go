package numa

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// ParseList reads a kernel CPU or node list ("0-3,8,10-11", as in
// cpulist, thread_siblings_list and shared_cpu_list; empty or blank for
// none) into sorted, distinct numbers.
func ParseList(s string) ([]int, error) {
	var out []int
	for _, part := range strings.Split(strings.TrimSpace(s), ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		lo, hi, ranged := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 {
			return nil, fmt.Errorf("list %q: %q is not a number or range", s, part)
		}
		b := a
		if ranged {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return nil, fmt.Errorf("list %q: %q is not a range LOW-HIGH", s, part)
			}
		}
		for i := a; i <= b; i++ {
			out = append(out, i)
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// FormatList writes sorted, distinct numbers as the kernel's list form,
// the inverse of ParseList: FormatList([]int{0, 1, 2, 4}) is "0-2,4".
// It is also the form of /proc/PID/status's Cpus_allowed_list and of
// numactl --physcpubind.
func FormatList(xs []int) string {
	var b strings.Builder
	for i := 0; i < len(xs); {
		j := i
		for j+1 < len(xs) && xs[j+1] == xs[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(xs[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(xs[j]))
		}
		i = j + 1
	}
	return b.String()
}

// intersect returns the numbers of sorted a that are also in sorted b.
func intersect(a, b []int) []int {
	var out []int
	for i, j := 0, 0; i < len(a) && j < len(b); {
		switch {
		case a[i] < b[j]:
			i++
		case a[i] > b[j]:
			j++
		default:
			out = append(out, a[i])
			i++
			j++
		}
	}
	return out
}
