// Package stats holds the little arithmetic the benchmark programs share.
package stats

import (
	"cmp"
	"math"
	"slices"
)

// Median returns the median of v (the mean of the middle two for an even
// count), or 0 for none. v is not modified.
func Median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Quantile is the nearest-rank q-quantile of v (q in (0, 1]): the smallest
// value with at least q of the values at or below it. The zero value for
// none. v is not modified.
func Quantile[T cmp.Ordered](v []T, q float64) T {
	if len(v) == 0 {
		var zero T
		return zero
	}
	s := slices.Sorted(slices.Values(v))
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(i, 0)]
}
