package stats

import (
	"slices"
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	for _, tt := range []struct {
		v    []float64
		want float64
	}{{nil, 0}, {[]float64{3}, 3}, {[]float64{3, 1, 2}, 2}, {[]float64{4, 1, 3, 2}, 2.5}} {
		if got := Median(tt.v); got != tt.want {
			t.Errorf("Median(%v) = %g, want %g", tt.v, got, tt.want)
		}
	}
}

func TestQuantile(t *testing.T) {
	ten := []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}
	tests := []struct {
		v    []float64
		q    float64
		want float64
	}{
		{ten, 0.9, 9},
		{ten, 0.5, 5},
		{ten, 1, 10},
		{[]float64{7}, 0.9, 7},
		{[]float64{1, 2, 3}, 0.9, 3},
		{nil, 0.9, 0},
	}
	for _, tt := range tests {
		if got := Quantile(tt.v, tt.q); got != tt.want {
			t.Errorf("Quantile(%v, %g) = %g, want %g", tt.v, tt.q, got, tt.want)
		}
	}
	if !slices.Equal(ten, []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}) {
		t.Error("quantile sorted its argument")
	}
}

func TestQuantileDurations(t *testing.T) {
	v := []time.Duration{3 * time.Second, time.Second, 2 * time.Second}
	if got := Quantile(v, 0.9); got != 3*time.Second {
		t.Errorf("p90 of %v = %v", v, got)
	}
}
