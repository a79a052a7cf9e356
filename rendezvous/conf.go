package rendezvous

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Conf is --rdzv-conf: KEY=VALUE options read by the dynamic rendezvous
// (its timeouts, ParseDynamicConfig) and by the store backends
// (read_timeout, is_host, store_type; etcd's keys). Every reader goes
// through these methods, so a bad value is worded one way (ConfError) and
// seconds are parsed once (ParseSeconds).
type Conf map[string]string

// ConfError is a bad --rdzv-conf value. It matches ErrInvalidArgument.
type ConfError struct {
	Key, Value string
	// Want says what the key takes ("a positive number of seconds").
	Want string
}

func (e *ConfError) Error() string {
	return fmt.Sprintf("--rdzv-conf %s=%s: want %s", e.Key, e.Value, e.Want)
}

func (e *ConfError) Unwrap() error { return ErrInvalidArgument }

// Seconds reads key as a positive number of seconds (ParseSeconds), or
// returns def when the key is absent. torchrun reads these with get_as_int;
// fractions are gorun's extension.
func (c Conf) Seconds(key string, def time.Duration) (time.Duration, error) {
	v, ok := c[key]
	if !ok {
		return def, nil
	}
	d, err := ParseSeconds(v)
	if err != nil {
		return 0, &ConfError{Key: key, Value: v, Want: "a positive number of seconds"}
	}
	return d, nil
}

// Count reads key as a positive integer, or returns def when absent.
func (c Conf) Count(key string, def int) (int, error) {
	v, ok := c[key]
	if !ok {
		return def, nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 1 {
		return 0, &ConfError{Key: key, Value: v, Want: "a positive integer"}
	}
	return n, nil
}

// Bool reads key the way torchrun's get_as_bool does (1/true/t/yes/y,
// 0/false/f/no/n, any case), or returns def when absent.
func (c Conf) Bool(key string, def bool) (bool, error) {
	v, ok := c[key]
	if !ok {
		return def, nil
	}
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "1", "true", "t", "yes", "y":
		return true, nil
	case "0", "false", "f", "no", "n":
		return false, nil
	}
	return false, &ConfError{Key: key, Value: v, Want: "a boolean (1, true, yes, 0, false, no)"}
}

// OneOf reads key as one of allowed (any case; the result is lower case),
// or returns def when absent.
func (c Conf) OneOf(key, def string, allowed ...string) (string, error) {
	v, ok := c[key]
	if !ok {
		return def, nil
	}
	if l := strings.ToLower(strings.TrimSpace(v)); slices.Contains(allowed, l) {
		return l, nil
	}
	return "", &ConfError{Key: key, Value: v, Want: "one of " + strings.Join(allowed, ", ")}
}

// ParseSeconds reads a positive, finite number of seconds ("30", "1.5"),
// rounded to the nanosecond.
func ParseSeconds(s string) (time.Duration, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a number of seconds", s)
	}
	d, err := SecondsDuration(f)
	if err != nil {
		return 0, err
	}
	if d <= 0 {
		return 0, fmt.Errorf("%q: want a positive number of seconds", s)
	}
	return d, nil
}

// SecondsDuration converts a number of seconds (a command-line flag's
// float) to a Duration, rounded to the nanosecond. Negative values pass
// through, for the caller to apply its own rule; NaN and values beyond a
// Duration's range are errors.
func SecondsDuration(f float64) (time.Duration, error) {
	if math.IsNaN(f) || math.Abs(f) >= math.MaxInt64/float64(time.Second) {
		return 0, fmt.Errorf("%v is not a usable number of seconds", f)
	}
	return time.Duration(math.Round(f * float64(time.Second))), nil
}
