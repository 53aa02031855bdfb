package sim

// Timing is the worker's prefill and decode time model (simulator.md), in
// milliseconds. The defaults are the reference simulator's uncalibrated
// polynomial: a configuration whose six coefficients are all zero takes
// them (withDefaults), whatever its KVBytesPerToken.
type Timing struct {
	PrefillA, PrefillB, PrefillC float64 // prefill(N) = A·N² + B·N + C, N uncached tokens
	DecodeA, DecodeB, DecodeC    float64 // decode(u) = max(1, A·u² + B·u + C), u KV fraction in use
	// KVBytesPerToken is the model's KV cache per token (every layer, K and
	// V): a block of the engine's block size is that many bytes times its
	// tokens when it moves between tiers (OffloadConfig). 0 means the
	// default, 131,072: Llama-3.1-8B in 16-bit (32 layers × 8 KV heads ×
	// 128 dims × 2 × 2 bytes), the size class the prefill polynomial's
	// speed suggests; a 64-token block is then 8 MiB.
	KVBytesPerToken float64
}

// DefaultKVBytesPerToken is Timing.KVBytesPerToken's default.
const DefaultKVBytesPerToken = 131072

// DefaultTiming returns simulator.md's model: 512 new tokens ≈ 24 ms,
// 8,192 ≈ 169 ms; a decode step ≈ 6 ms empty, ≈ 34 ms full.
func DefaultTiming() Timing {
	return Timing{PrefillA: 4.21e-7, PrefillB: 1.518e-2, PrefillC: 16.5, DecodeA: -25.74, DecodeB: 54.01, DecodeC: 5.74,
		KVBytesPerToken: DefaultKVBytesPerToken}
}

// withDefaults gives t the default polynomial when it sets none of the six
// coefficients, keeping its KVBytesPerToken: a configuration that sets the
// KV size alone (0 meaning its default) must not get a model in which
// every pass is free.
func (t Timing) withDefaults() Timing {
	if t.PrefillA == 0 && t.PrefillB == 0 && t.PrefillC == 0 && t.DecodeA == 0 && t.DecodeB == 0 && t.DecodeC == 0 {
		kv := t.KVBytesPerToken
		t = DefaultTiming()
		if kv > 0 {
			t.KVBytesPerToken = kv
		}
	}
	return t
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

// BlockBytes is the real KV size of a block of blockSize tokens.
func (t Timing) BlockBytes(blockSize int) float64 {
	b := t.KVBytesPerToken
	if b <= 0 {
		b = DefaultKVBytesPerToken
	}
	return b * float64(blockSize)
}

// TransferMs is the time to move blocks of blockSize tokens at gbps GB/s
// (1e9 bytes per second). Moving no blocks takes no time, whatever the
// block's size: 0 × an infinite size would be NaN.
func (t Timing) TransferMs(blocks, blockSize int, gbps float64) float64 {
	if blocks == 0 {
		return 0
	}
	return float64(blocks) * t.BlockBytes(blockSize) / (gbps * 1e9) * 1e3
}
