package sim

// Timing is the worker's prefill and decode time model (simulator.md), in
// milliseconds. The defaults are the reference simulator's uncalibrated
// polynomial.
type Timing struct {
	PrefillA, PrefillB, PrefillC float64 // prefill(N) = A·N² + B·N + C, N uncached tokens
	DecodeA, DecodeB, DecodeC    float64 // decode(u) = max(1, A·u² + B·u + C), u KV fraction in use
}

// DefaultTiming returns simulator.md's model: 512 new tokens ≈ 24 ms,
// 8,192 ≈ 169 ms; a decode step ≈ 6 ms empty, ≈ 34 ms full.
func DefaultTiming() Timing {
	return Timing{PrefillA: 4.21e-7, PrefillB: 1.518e-2, PrefillC: 16.5, DecodeA: -25.74, DecodeB: 54.01, DecodeC: 5.74}
}

// PrefillMs is the time to prefill n uncached tokens.
func (t Timing) PrefillMs(n int) float64 {
	x := float64(n)
	return t.PrefillA*x*x + t.PrefillB*x + t.PrefillC
}

// DecodeStepMs is the time of one decode step at KV use u in [0, 1].
func (t Timing) DecodeStepMs(u float64) float64 {
	return max(1, t.DecodeA*u*u+t.DecodeB*u+t.DecodeC)
}
