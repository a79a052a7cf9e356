package rendezvous

import (
	"errors"
	"math"
	"strconv"
	"testing"
)

// TestParseCounter pins C's stoll rules in base 10, which c10d applies to
// counter values.
func TestParseCounter(t *testing.T) {
	cases := []struct {
		in   string
		want int64
		bad  bool
	}{
		{in: "0", want: 0},
		{in: "42", want: 42},
		{in: "-7", want: -7},
		{in: "+7", want: 7},
		{in: " \t\n\v\f\r12", want: 12},
		{in: "12abc", want: 12},
		{in: "12 34", want: 12},
		{in: "007", want: 7},
		{in: "9223372036854775807", want: math.MaxInt64},
		{in: "-9223372036854775808", want: math.MinInt64},
		{in: "9223372036854775808", bad: true},
		{in: "-9223372036854775809", bad: true},
		{in: "", bad: true},
		{in: "abc", bad: true},
		{in: "-", bad: true},
		{in: " +", bad: true},
		{in: "0x10", want: 0}, // base 10: stops at 'x'
	}
	for _, tc := range cases {
		got, err := ParseCounter([]byte(tc.in))
		if tc.bad {
			if !errors.Is(err, ErrNotInteger) {
				t.Errorf("ParseCounter(%q) = %d, %v; want ErrNotInteger", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseCounter(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

func TestAddCounter(t *testing.T) {
	cases := []struct {
		old     string
		present bool
		delta   int64
		want    int64
		bad     bool
	}{
		{present: false, delta: 5, want: 5},
		{old: "5", present: true, delta: -2, want: 3},
		{old: "x", present: true, delta: 1, bad: true},
		{old: "", present: true, delta: 1, bad: true}, // TCPStore: stoll("") throws
		{old: strconv.FormatInt(math.MaxInt64, 10), present: true, delta: 1, bad: true},
		{old: strconv.FormatInt(math.MinInt64, 10), present: true, delta: -1, bad: true},
		{old: "1", present: true, delta: 0, want: 1},
	}
	for _, tc := range cases {
		got, b, err := AddCounter([]byte(tc.old), tc.present, tc.delta)
		if tc.bad {
			if !errors.Is(err, ErrNotInteger) {
				t.Errorf("AddCounter(%q, %v, %d) = %d, %v; want ErrNotInteger", tc.old, tc.present, tc.delta, got, err)
			}
			continue
		}
		if err != nil || got != tc.want || string(b) != strconv.FormatInt(tc.want, 10) {
			t.Errorf("AddCounter(%q, %v, %d) = %d %q %v; want %d", tc.old, tc.present, tc.delta, got, b, err, tc.want)
		}
	}
}
