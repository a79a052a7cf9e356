package rendezvous

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestConfReaders(t *testing.T) {
	conf := Conf{"d": "1.5", "n": "4", "b": "Y", "e": "FILE", "bad": "soon", "neg": "-1", "nan": "NaN", "huge": "1e300", "tiny": "1e-12"}
	type result struct {
		got any
		err error
	}
	cases := []struct {
		name string
		call func() result
		want any    // when no error
		bad  string // the error's text, when one is expected
	}{
		{"seconds", func() result { d, err := conf.Seconds("d", 0); return result{d, err} }, 1500 * time.Millisecond, ""},
		{"seconds default", func() result { d, err := conf.Seconds("absent", 7*time.Second); return result{d, err} }, 7 * time.Second, ""},
		{"seconds word", func() result { d, err := conf.Seconds("bad", 0); return result{d, err} }, nil, "--rdzv-conf bad=soon: want a positive number of seconds"},
		{"seconds negative", func() result { d, err := conf.Seconds("neg", 0); return result{d, err} }, nil, "neg=-1"},
		{"seconds NaN", func() result { d, err := conf.Seconds("nan", 0); return result{d, err} }, nil, "nan=NaN"},
		{"seconds huge", func() result { d, err := conf.Seconds("huge", 0); return result{d, err} }, nil, "huge=1e300"},
		{"seconds below a nanosecond", func() result { d, err := conf.Seconds("tiny", 0); return result{d, err} }, nil, "tiny=1e-12"},
		{"count", func() result { n, err := conf.Count("n", 0); return result{n, err} }, 4, ""},
		{"count bad", func() result { n, err := conf.Count("d", 0); return result{n, err} }, nil, "d=1.5: want a positive integer"},
		{"bool", func() result { b, err := conf.Bool("b", false); return result{b, err} }, true, ""},
		{"bool bad", func() result { b, err := conf.Bool("n", false); return result{b, err} }, nil, "n=4: want a boolean"},
		{"one of", func() result { v, err := conf.OneOf("e", "tcp", "tcp", "file"); return result{v, err} }, "file", ""},
		{"one of default", func() result { v, err := conf.OneOf("absent", "tcp", "tcp", "file"); return result{v, err} }, "tcp", ""},
		{"one of bad", func() result { v, err := conf.OneOf("b", "tcp", "tcp", "file"); return result{v, err} }, nil, "b=Y: want one of tcp, file"},
	}
	for _, tc := range cases {
		r := tc.call()
		switch {
		case tc.bad == "" && (r.err != nil || r.got != tc.want):
			t.Errorf("%s = %v, %v; want %v", tc.name, r.got, r.err, tc.want)
		case tc.bad != "" && (!errors.Is(r.err, ErrInvalidArgument) || !strings.Contains(r.err.Error(), tc.bad)):
			t.Errorf("%s: err %v; want ErrInvalidArgument saying %q", tc.name, r.err, tc.bad)
		}
	}
}

func TestSecondsDuration(t *testing.T) {
	for _, tc := range []struct {
		in   float64
		want time.Duration
		ok   bool
	}{
		{0.25, 250 * time.Millisecond, true},
		{0, 0, true},
		{-2, -2 * time.Second, true}, // the caller's rule decides
		{1e-10, 0, true},             // rounds to the nanosecond
		{1e300, 0, false},
	} {
		d, err := SecondsDuration(tc.in)
		if (err == nil) != tc.ok || (tc.ok && d != tc.want) {
			t.Errorf("SecondsDuration(%v) = %v, %v; want %v ok=%v", tc.in, d, err, tc.want, tc.ok)
		}
	}
}
