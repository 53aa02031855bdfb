package engineapi

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
)

// The API's paths. Every request and answer body is JSON.
const (
	PathRegion     = "/v1/region"     // POST RegisterRequest → RegisterResponse
	PathUnregister = "/v1/unregister" // POST UnregisterRequest → UnregisterResponse
	PathOffload    = "/v1/offload"    // POST OffloadRequest → OffloadResponse
	PathFree       = "/v1/free"       // POST FreeRequest → FreeResponse
	PathLookup     = "/v1/lookup"     // POST LookupRequest → LookupResponse
	PathOnboard    = "/v1/onboard"    // POST OnboardRequest → OnboardResponse
	PathStats      = "/v1/stats"      // GET → StatsResponse
	PathHealth     = "/healthz"       // GET → {"status":"ok"}
)

// Errors a caller branches on. A Client returns an *Error that wraps one of
// them (errors.Is works); the server answers each with its HTTP status and
// code (see Error).
var (
	// ErrBadRequest means the request can never succeed as it is: malformed
	// JSON, a body that is not an object, an unknown, misspelled (field
	// names are exact, case included) or repeated field, no dp_rank, an
	// offload block without g1_block, hash or local, a G1 block id out of
	// the region, a zero hash, an offload block that contradicts what the
	// engine reported (Config.Checker), mismatched lengths, a region that
	// cannot be mapped or has more blocks than Config.MaxRegionBlocks.
	// Nothing changed.
	ErrBadRequest = errors.New("bad request")
	// ErrUnknownRank means the agent does not follow that dp rank.
	ErrUnknownRank = errors.New("unknown dp rank")
	// ErrNotRegistered means the rank has no G1 region registered (or it was
	// being replaced or unregistered while the request ran).
	ErrNotRegistered = errors.New("no G1 region registered for the rank")
	// ErrClosed means the agent is shutting down.
	ErrClosed = errors.New("offload server closed")
)

// Error is an error answer: its HTTP status, its code (bad_request,
// unknown_rank, not_registered, closed, not_found, method_not_allowed,
// internal) and message. The body of every error answer is
// {"error": Message, "code": Code}.
type Error struct {
	Status  int    `json:"-"`
	Code    string `json:"code"`
	Message string `json:"error"`
}

func (e *Error) Error() string { return fmt.Sprintf("%s (%d %s)", e.Message, e.Status, e.Code) }

// Unwrap returns the sentinel error of the code (nil for internal and the
// routing errors).
func (e *Error) Unwrap() error {
	switch e.Code {
	case codeBadRequest:
		return ErrBadRequest
	case codeUnknownRank:
		return ErrUnknownRank
	case codeNotRegistered:
		return ErrNotRegistered
	case codeClosed:
		return ErrClosed
	}
	return nil
}

const (
	codeBadRequest    = "bad_request"
	codeUnknownRank   = "unknown_rank"
	codeNotRegistered = "not_registered"
	codeClosed        = "closed"
	codeNotFound      = "not_found"
	codeMethod        = "method_not_allowed"
	codeInternal      = "internal"
)

// Hash is a 64-bit block hash. In JSON it is an integer, unsigned
// (0 … 2⁶⁴−1) or signed (−2⁶³ … −1, an engine's signed hash, taken as the
// unsigned number with the same 64 bits, as the event path does). Any other
// JSON value (a fraction, an exponent, a string, null) is refused. Answers
// write hashes unsigned.
type Hash uint64

// UnmarshalJSON decodes an integer, signed or unsigned.
func (h *Hash) UnmarshalJSON(b []byte) error {
	s := string(bytes.TrimSpace(b))
	if len(s) > 0 && s[0] == '-' {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("hash %.40s: want a 64-bit integer", s)
		}
		*h = Hash(uint64(v))
		return nil
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return fmt.Errorf("hash %.40s: want a 64-bit integer", s)
	}
	*h = Hash(v)
	return nil
}

// RegisterRequest registers a dp rank's G1 region: NumBlocks blocks of
// BlockSizeBytes bytes each, block id i at byte offset i × BlockSizeBytes.
// Exactly one of IPCHandle (the 64 bytes of a cudaIpcMemHandle_t, base64 in
// JSON; with the host backend, the bytes of a file path) and ShmPath (an
// absolute path of a shared-memory file, host backend only) names it.
// BlockSizeBytes must be the agent's --block-bytes.
type RegisterRequest struct {
	DPRank         uint32 `json:"dp_rank"`
	IPCHandle      []byte `json:"ipc_handle,omitempty"`
	ShmPath        string `json:"shm_path,omitempty"`
	BlockSizeBytes int    `json:"block_size_bytes"`
	NumBlocks      int    `json:"num_blocks"`
}

// RegisterResponse says whether a region was replaced, and which backend
// copies (host or cuda).
type RegisterResponse struct {
	DPRank   uint32 `json:"dp_rank"`
	Replaced bool   `json:"replaced"`
	Backend  string `json:"backend"`
}

// UnregisterRequest drops a rank's region (the engine is going away): as a
// replacement does, it frees every G1 block, closes the rank's Manager and
// unmaps the region. The pools keep their blocks.
type UnregisterRequest struct {
	DPRank uint32 `json:"dp_rank"`
}

// UnregisterResponse says whether a region was registered.
type UnregisterResponse struct {
	Unregistered bool `json:"unregistered"`
}

// OffloadRequest asks for G1 blocks to be written through to G2 (or to G3
// when the agent has no G2 pool).
type OffloadRequest struct {
	DPRank uint32         `json:"dp_rank"`
	Blocks []OffloadBlock `json:"blocks"`
}

// OffloadBlock is one block to offload: G1Block holds its final bytes;
// Hash is its sequence hash (the engine's block hash, never 0), Parent the
// previous block's (0, or left out, for the first block of a sequence),
// Local its content hash (kvevent.LocalHash of its tokens: what the agent
// computes from the engine's events, so that the G2/G3 copy lands on the
// same node of the router's tree). G1Block, Hash and Local are required.
// Priority orders the queue, higher first; a negative priority means "do
// not write through".
//
// Where the agent already holds the engine's STORE of Hash, Parent and
// Local must be what it reported (Config.Checker): otherwise the router
// would take the pool's copy for the engine reusing the hash and forget
// the engine's block.
type OffloadBlock struct {
	G1Block  int  `json:"g1_block" required:"true"`
	Hash     Hash `json:"hash" required:"true"`
	Parent   Hash `json:"parent"`
	Local    Hash `json:"local" required:"true"`
	Priority int  `json:"priority"`
}

// OffloadResponse counts what became of the request's blocks (see
// manager.OffloadResult). Shed counts the tasks the full queue dropped
// during the call, of this request or older ones of lower priority.
type OffloadResponse struct {
	Queued     int `json:"queued"`
	Shed       int `json:"shed"`
	NoPriority int `json:"no_priority"`
	Duplicate  int `json:"duplicate"`
	Cold       int `json:"cold"`
	NoDisk     int `json:"no_disk"`
}

// FreeRequest tells the agent that the engine freed G1 blocks, or is about
// to write other data into them. The engine must call it, and wait for the
// answer, before it writes into a block it offloaded. It names at most
// MaxRequestBlocks ids, or the region's NumBlocks if that is more.
type FreeRequest struct {
	DPRank   uint32 `json:"dp_rank"`
	G1Blocks []int  `json:"g1_blocks"`
}

// FreeResponse counts the blocks freed.
type FreeResponse struct {
	Freed int `json:"freed"`
}

// LookupRequest asks which tiers hold blocks, at most MaxRequestBlocks. It
// works before a region is registered (it asks the pools).
type LookupRequest struct {
	DPRank uint32 `json:"dp_rank"`
	Hashes []Hash `json:"hashes"`
}

// LookupResponse gives, per hash in request order, the tiers that hold the
// block now ("host", "disk"; empty when none), and Prefix, the number of
// leading hashes held in some tier. Nothing is pinned: a block may be
// evicted right after.
type LookupResponse struct {
	Tiers  [][]string `json:"tiers"`
	Prefix int        `json:"prefix"`
}

// OnboardRequest asks for blocks to be copied back into G1: Hashes[i] into
// G1 block G1Blocks[i], within TimeoutMs (0: the agent's default, at most
// MaxTimeoutMs). The destinations count as freed first.
type OnboardRequest struct {
	DPRank    uint32 `json:"dp_rank"`
	Hashes    []Hash `json:"hashes"`
	G1Blocks  []int  `json:"g1_blocks"`
	TimeoutMs int    `json:"timeout_ms"`
}

// MaxTimeoutMs bounds OnboardRequest.TimeoutMs.
const MaxTimeoutMs = 60_000

// MaxRequestBlocks bounds the hashes of a LookupRequest, and the ids of a
// FreeRequest unless the region has more blocks: the agent holds its locks
// across the whole request, so a larger one is refused (bad_request) rather
// than stall the engine's other calls. Offload and Onboard name each G1
// block at most once, so the region's size bounds them. A list longer than
// any of these bounds could allow is refused before the body is decoded.
const MaxRequestBlocks = 65_536

// OnboardResponse gives, per block in request order, its status: "loaded"
// (the bytes are in its G1 block), "not_found", "timeout", "canceled" or
// "error"; From is the tier it was found in. Loaded counts the loaded
// blocks, Prefix the leading ones (what the engine need not recompute).
//
// Settled is true when no copy this onboard started can still write into
// G1: the answer waits for that, up to the server's SettleTimeout past the
// deadline. When false (a copy into G1 stalled), every block that is not
// loaded may still be written: the engine must neither write into those G1
// blocks nor reuse them until it registers its region again (which waits
// for every copy).
type OnboardResponse struct {
	Blocks  []OnboardBlock `json:"blocks"`
	Loaded  int            `json:"loaded"`
	Prefix  int            `json:"prefix"`
	Settled bool           `json:"settled"`
}

// OnboardBlock is the outcome for one block of an onboard.
type OnboardBlock struct {
	Status string `json:"status"`
	From   string `json:"from,omitempty"`
	Error  string `json:"error,omitempty"`
}

// StatsResponse is GET /v1/stats: the backend and, per rank, its region
// and counters.
type StatsResponse struct {
	Backend string      `json:"backend"`
	Ranks   []RankStats `json:"ranks"`
}

// RankStats is one rank's state. Manager is present while a region is
// registered; its counters start at zero with each registration.
type RankStats struct {
	DPRank         uint32        `json:"dp_rank"`
	Registered     bool          `json:"registered"`
	BlockSizeBytes int           `json:"block_size_bytes"`
	NumBlocks      int           `json:"num_blocks,omitempty"`
	Host           *PoolStats    `json:"host,omitempty"`
	Disk           *PoolStats    `json:"disk,omitempty"`
	Manager        *ManagerStats `json:"manager,omitempty"`
}

// PoolStats is pool.Stats.
type PoolStats struct {
	Capacity      int    `json:"capacity"`
	Used          int    `json:"used"`
	Pending       int    `json:"pending"`
	Referenced    int    `json:"referenced"`
	Inactive      int    `json:"inactive"`
	Evictable     int    `json:"evictable"`
	Hits          uint64 `json:"hits"`
	Misses        uint64 `json:"misses"`
	Registered    uint64 `json:"registered"`
	Revived       uint64 `json:"revived"`
	Evictions     uint64 `json:"evictions"`
	PublishErrors uint64 `json:"publish_errors"`
	Damaged       uint64 `json:"damaged"` // disk blocks whose bytes failed to read, dropped
}

// ManagerStats is manager.Stats; Paths is keyed by path name (d2h, d2disk,
// h2disk, h2d, disk2h), for the paths the rank's pools allow.
type ManagerStats struct {
	Paths      map[string]CopyPathStats `json:"paths"`
	Invalid    uint64                   `json:"invalid"`
	NoPriority uint64                   `json:"no_priority"`
	Duplicates uint64                   `json:"duplicates"`
	Cold       uint64                   `json:"cold"`
	NoDisk     uint64                   `json:"no_disk"`
	DiskDown   bool                     `json:"disk_down"`
	Tracked    int                      `json:"tracked"`
	Onboard    OnboardStats             `json:"onboard"`
}

// CopyPathStats is manager.PathStats: one copy path's counters, in blocks.
type CopyPathStats struct {
	Depth    int    `json:"depth"`
	InFlight int    `json:"inflight"`
	Queued   uint64 `json:"queued"`
	Shed     uint64 `json:"shed"`
	Skipped  uint64 `json:"skipped"`
	Exists   uint64 `json:"exists"`
	Full     uint64 `json:"full"`
	Failed   uint64 `json:"failed"`
	Blocks   uint64 `json:"blocks"`
	Bytes    uint64 `json:"bytes"`
}

// OnboardStats is manager.OnboardStats.
type OnboardStats struct {
	Calls      uint64 `json:"calls"`
	FromHost   uint64 `json:"from_host"`
	FromDisk   uint64 `json:"from_disk"`
	NotFound   uint64 `json:"not_found"`
	TimedOut   uint64 `json:"timed_out"`
	Canceled   uint64 `json:"canceled"`
	Failed     uint64 `json:"failed"`
	LateWrites uint64 `json:"late_writes"`
}

// Idle reports whether no path of the rank has blocks queued or in flight
// (true when no region is registered).
func (r RankStats) Idle() bool {
	if r.Manager == nil {
		return true
	}
	for _, p := range r.Manager.Paths {
		if p.Depth != 0 || p.InFlight != 0 {
			return false
		}
	}
	return true
}

// Rank returns the stats of dp rank dp, and whether the agent serves it.
func (s StatsResponse) Rank(dp uint32) (RankStats, bool) {
	for _, r := range s.Ranks {
		if r.DPRank == dp {
			return r, true
		}
	}
	return RankStats{}, false
}
