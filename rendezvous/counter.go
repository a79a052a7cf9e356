package rendezvous

import (
	"fmt"
	"math"
	"strconv"
)

// ParseCounter reads a counter value the way c10d does (C's stoll in base
// 10): leading whitespace is skipped, an optional sign is accepted, and
// parsing stops at the first non-digit, so "12abc" is 12. No digits at all,
// or a value outside int64, is an error wrapping ErrNotInteger.
func ParseCounter(b []byte) (int64, error) {
	i := 0
	for i < len(b) && isCSpace(b[i]) {
		i++
	}
	neg := false
	if i < len(b) && (b[i] == '+' || b[i] == '-') {
		neg = b[i] == '-'
		i++
	}
	start := i
	var v uint64
	// The magnitude limit is 2^63 for negatives, 2^63-1 for positives.
	limit := uint64(math.MaxInt64)
	if neg {
		limit++
	}
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		d := uint64(b[i] - '0')
		if v > (limit-d)/10 {
			return 0, fmt.Errorf("%w: %q overflows int64", ErrNotInteger, b)
		}
		v = v*10 + d
		i++
	}
	if i == start {
		return 0, fmt.Errorf("%w: %q", ErrNotInteger, b)
	}
	if neg {
		return int64(-v), nil // -(2^63) wraps to MinInt64, as intended
	}
	return int64(v), nil
}

// AddCounter returns the counter value old (nil when the key is absent) plus
// delta, as c10d's ADD computes it, and the decimal bytes to store.
func AddCounter(old []byte, present bool, delta int64) (int64, []byte, error) {
	var cur int64
	if present {
		v, err := ParseCounter(old)
		if err != nil {
			return 0, nil, err
		}
		cur = v
	}
	sum := cur + delta
	if (delta > 0 && sum < cur) || (delta < 0 && sum > cur) {
		return 0, nil, fmt.Errorf("%w: %d%+d overflows int64", ErrNotInteger, cur, delta)
	}
	return sum, strconv.AppendInt(nil, sum, 10), nil
}

// isCSpace is C's isspace in the "C" locale.
func isCSpace(c byte) bool {
	switch c {
	case ' ', '\t', '\n', '\v', '\f', '\r':
		return true
	}
	return false
}
