package engine

import "errors"

var (
	// ErrPayload means a payload is not a decodable batch: it is truncated,
	// not valid msgpack, not shaped as [ts, events, dp_rank?] or
	// {ts, events, data_parallel_rank}, or has bytes after the batch. Nothing
	// from it is emitted and the Batch is left as it was; the error wraps the
	// byte offset and the cause. A malformed *event* is not an ErrPayload: it
	// is skipped and counted in Stats, and the rest of the batch decodes.
	ErrPayload = errors.New("malformed payload")
	// ErrOtherDPRank marks an ErrPayload (it wraps both) of a batch whose
	// data_parallel_rank names another dp rank than Config.Rank.DP, read
	// before its events once the decoder has seen another rank's batch:
	// the batch was never the followed rank's, so nothing of that rank is
	// lost with it, and the copies counted for it stay.
	ErrOtherDPRank = errors.New("another dp rank's batch")
	// ErrConfig means a Decoder was configured with an impossible value.
	ErrConfig = errors.New("invalid decoder config")
)
