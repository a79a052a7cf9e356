// Package suggest finds the word a user probably meant: the nearest known
// flag or option to a misspelled one.
package suggest

// Nearest returns the word of words closest to w in edits (Levenshtein),
// or "" when none is within a third of w's length: a suggestion further
// off would be a guess.
func Nearest(w string, words []string) string {
	best, bestDist := "", len(w)/3+1
	for _, c := range words {
		if d := Distance(w, c); d < bestDist {
			best, bestDist = c, d
		}
	}
	return best
}

// Distance is the Levenshtein distance between a and b, in bytes.
func Distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
