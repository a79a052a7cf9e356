package suggest

import "testing"

func TestDistance(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want int
	}{
		{"", "", 0}, {"abc", "", 3}, {"", "ab", 2}, {"kitten", "sitting", 3},
		{"join_timout", "join_timeout", 1}, {"nproc-per-nod", "nproc-per-node", 1},
	} {
		if got := Distance(tc.a, tc.b); got != tc.want {
			t.Errorf("Distance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.want)
		}
	}
}

func TestNearest(t *testing.T) {
	words := []string{"join_timeout", "last_call_timeout", "read_timeout", "is_host"}
	for _, tc := range []struct{ w, want string }{
		{"join_timout", "join_timeout"},
		{"read_timeot", "read_timeout"},
		{"is_hots", "is_host"},
		{"foo", ""},     // nothing close
		{"timeout", ""}, // read_timeout is 5 edits off, more than a third
	} {
		if got := Nearest(tc.w, words); got != tc.want {
			t.Errorf("Nearest(%q) = %q, want %q", tc.w, got, tc.want)
		}
	}
}
