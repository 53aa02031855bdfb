package compat

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"mime"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/vmihailenco/msgpack/v5"
)

// Hash is a 64-bit block hash. The compatible APIs carry hashes as signed
// 64-bit integers; Hash writes them so and reads either form, signed or
// unsigned, in JSON and MessagePack.
type Hash uint64

// MarshalJSON writes h as a signed 64-bit integer.
func (h Hash) MarshalJSON() ([]byte, error) {
	return strconv.AppendInt(nil, int64(h), 10), nil
}

// UnmarshalJSON reads a signed or unsigned 64-bit integer.
func (h *Hash) UnmarshalJSON(b []byte) error {
	neg := len(b) > 0 && b[0] == '-'
	digits := b
	if neg {
		digits = b[1:]
	}
	if len(digits) == 0 {
		return fmt.Errorf("block hash %s: not a 64-bit integer", b)
	}
	var v uint64
	for _, c := range digits {
		if c < '0' || c > '9' {
			return fmt.Errorf("block hash %s: not a 64-bit integer", b)
		}
		d := uint64(c - '0')
		if v > (math.MaxUint64-d)/10 {
			return fmt.Errorf("block hash %s: not a 64-bit integer", b)
		}
		v = v*10 + d
	}
	if neg {
		if v > 1<<63 {
			return fmt.Errorf("block hash %s: not a 64-bit integer", b)
		}
		v = -v
	}
	*h = Hash(v)
	return nil
}

// EncodeMsgpack writes h as a signed 64-bit integer.
func (h Hash) EncodeMsgpack(e *msgpack.Encoder) error { return e.EncodeInt(int64(h)) }

// DecodeMsgpack reads a signed or unsigned integer. A nil is refused, as
// JSON's null is (UnmarshalJSON): a hash of null names no block, and the
// reference API refuses it.
func (h *Hash) DecodeMsgpack(d *msgpack.Decoder) error {
	v, err := d.DecodeInterfaceLoose()
	if err != nil {
		return err
	}
	switch v := v.(type) {
	case int64:
		*h = Hash(v)
	case uint64:
		*h = Hash(v)
	case nil:
		return errors.New("block hash: nil is not an integer")
	default:
		return fmt.Errorf("block hash: %T is not an integer", v)
	}
	return nil
}

// The msgpack library reads a nil as the zero value before it calls a
// type's DecodeMsgpack: a block hash of nil read 0 where JSON's null is a
// 400. Registered, Hash's decoder sees the nil (a *Hash field, a parent
// hash, still reads a nil as none, as JSON's null).
func init() {
	msgpack.Register(Hash(0), nil, func(d *msgpack.Decoder, v reflect.Value) error {
		var h Hash
		err := h.DecodeMsgpack(d)
		v.SetUint(uint64(h))
		return err
	})
}

// TokenID is a prompt token id: an unsigned 32-bit integer.
type TokenID = uint32

// The two body encodings.
const (
	contentJSON    = "application/json"
	contentMsgpack = "application/msgpack"
)

// codec is the encoding of one request and of its answer.
type codec uint8

const (
	codecJSON codec = iota
	codecMsgpack
)

// codecOf returns the request's encoding: its Content-Type when it names
// one, else its Accept header; JSON unless MessagePack is named.
func codecOf(r *http.Request) codec {
	h := r.Header.Get("Content-Type")
	if h == "" {
		h = r.Header.Get("Accept")
	}
	if mt, _, err := mime.ParseMediaType(h); err == nil {
		switch mt {
		case contentMsgpack, "application/x-msgpack", "application/vnd.msgpack":
			return codecMsgpack
		}
	}
	return codecJSON
}

// errBody is a request body that does not decode.
var errBody = errors.New("bad request body")

// decode reads the request body into v in the request's encoding. Unknown
// fields are ignored (peers add fields); an empty body is an error.
func decode(r *http.Request, c codec, v any) error {
	b, err := readBody(r)
	if err != nil {
		return err
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return fmt.Errorf("%w: empty", errBody)
	}
	return decodeBytes(b, c, v)
}

// decodeOptional decodes r's body into v as decode does, but for a body
// that is optional: one that is empty or all whitespace names no field
// and leaves v as it is. The body is read to learn that: a client that
// streams it (chunked, no Content-Length) sends no length to go by.
func decodeOptional(r *http.Request, c codec, v any) error {
	b, err := readBody(r)
	if err != nil || len(bytes.TrimSpace(b)) == 0 {
		return err
	}
	return decodeBytes(b, c, v)
}

// readBody reads r's whole body; errBody when it is over the server's
// limit (413, as on /v1) or cannot be read (the status api.BodyReadError
// gives).
func readBody(r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &httpError{code: http.StatusRequestEntityTooLarge,
				err: fmt.Errorf("%w: larger than %d bytes", errBody, mbe.Limit)}
		}
		// A stalled body is 408 and a broken one 503, as on the /v1 API;
		// the message names no address.
		code, msg := api.BodyReadError(err)
		return nil, &httpError{code: code, err: fmt.Errorf("%w: %w", errBody, msg)}
	}
	return b, nil
}

// decodeBytes decodes a body of encoding c, not empty, into v. A
// MessagePack body goes to the library only once checkMsgpack has passed
// it; a body of either encoding is refused when its arrays would decode
// into more than decodeBudget of memory (checkMsgpackShape,
// checkJSONShape).
func decodeBytes(b []byte, c codec, v any) error {
	if f, ok := v.(jsonScanner); ok && c == codecJSON && f.scanJSON(b) {
		return nil
	}
	if c == codecMsgpack {
		if err := checkMsgpack(b); err != nil {
			return bodyError("msgpack", err)
		}
		if err := checkMsgpackShape(b, reflect.TypeOf(v)); err != nil {
			return bodyError("msgpack", err)
		}
		d := msgpack.NewDecoder(bytes.NewReader(b))
		d.SetCustomStructTag("json")
		if err := d.Decode(v); err != nil {
			return bodyError("msgpack", err)
		}
		return nil
	}
	b, err := checkJSONShape(b, reflect.TypeOf(v))
	if err != nil {
		return bodyError("json", err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return bodyError("json", err)
	}
	return nil
}

// bodyError is err, of a body of encoding enc ("json" or "msgpack"), as
// an errBody naming the encoding once: the libraries' own errors start
// with it ("json: cannot unmarshal ..."), and were answered "bad request
// body: json: json: cannot unmarshal ...".
func bodyError(enc string, err error) error {
	if strings.HasPrefix(err.Error(), enc+": ") {
		return fmt.Errorf("%w: %v", errBody, err)
	}
	return fmt.Errorf("%w: %s: %v", errBody, enc, err)
}

// jsonScanner is a request type with a one-pass reader of its common
// JSON shape (internal/jsonscan); when scanJSON reports false, the body is
// decoded with encoding/json, which then says what is wrong with it.
type jsonScanner interface {
	scanJSON(b []byte) bool
}

// write answers v with status code in encoding c. Map keys are sorted in
// both encodings, so equal answers are equal bytes.
func write(w http.ResponseWriter, c codec, code int, v any) error {
	var buf bytes.Buffer
	if c == codecMsgpack {
		e := msgpack.NewEncoder(&buf)
		e.SetCustomStructTag("json")
		e.SetSortMapKeys(true)
		e.UseCompactInts(true)
		if err := e.Encode(v); err != nil {
			return fmt.Errorf("encode answer: %w", err)
		}
		w.Header().Set("Content-Type", contentMsgpack)
	} else {
		if m, ok := v.(json.Marshaler); ok {
			// Our own writers (the query answer) write compact, valid JSON:
			// skip encoding/json's check and compaction of it.
			b, err := m.MarshalJSON()
			if err != nil {
				return fmt.Errorf("encode answer: %w", err)
			}
			buf.Write(b)
			buf.WriteByte('\n')
		} else if err := json.NewEncoder(&buf).Encode(v); err != nil {
			return fmt.Errorf("encode answer: %w", err)
		}
		w.Header().Set("Content-Type", contentJSON)
	}
	w.WriteHeader(code)
	_, err := w.Write(buf.Bytes())
	return err
}

// bodyHandler is a route whose request body decodes into a Req: do's
// answer goes out with code, in the request's encoding; its error as
// {"error": ...} (answer), or to the leader when it wraps
// raftfsm.ErrNotLeader.
func bodyHandler[Req any](code int, do func(ctx context.Context, req *Req) (any, error)) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		c := codecOf(r)
		var req Req
		if err := decode(r, c, &req); err != nil {
			return answer(w, c, 0, nil, err)
		}
		v, err := do(r.Context(), &req)
		return answer(w, c, code, v, err)
	}
}

// Limits on strings a client supplies, as on /v1 (api/validate.go): they
// keep Raft entries, snapshots and the namespace cache small, and ids
// printable. An id past raftfsm's own limit was committed and then
// refused by every replica's FSM: a wasted entry and a 500.
const (
	maxIDLen   = limits.MaxIDLen   // reservation, selection and session ids
	maxDPRanks = limits.MaxDPRanks // dp ranks of one worker
)

// requireModel refuses a request that names no model, or names too long:
// the model and the tenants (or routing groups) given.
func requireModel(model string, tenants ...string) error {
	if model == "" {
		return badRequest("model_name is required")
	}
	return checkNames(model, tenants...)
}

// checkNames bounds a model and the tenants (or routing groups) given, an
// empty one passing: those of a request where they only narrow a search
// (POST /events, PATCH and DELETE /selection/workers/{id}), which answered
// an overlong or invalid one 404 "not registered" with it echoed whole.
func checkNames(model string, tenants ...string) error {
	if err := checkName("model_name", model); err != nil {
		return err
	}
	for _, t := range tenants {
		if err := checkName("tenant_id or routing_group", t); err != nil {
			return err
		}
	}
	return nil
}

// checkName refuses a name longer than limits.MaxNameLen bytes, or not
// valid UTF-8. JSON carries only valid UTF-8 (encoding/json replaces
// invalid bytes, in what it reads and writes), MessagePack any bytes: two
// models "m\xff" and "m\xfe" registered through MessagePack were two
// namespaces that GET /dump and /selection/workers wrote under one JSON
// key, "m\ufffd:default".
func checkName(what, s string) error {
	if p := limits.Name(s); p != "" {
		return badRequest("%s %s", what, p)
	}
	if !utf8.ValidString(s) {
		return badRequest("%s is not valid UTF-8", what)
	}
	return nil
}

// checkPrintable refuses a name a registration writes into the worker
// table that checkName refuses, or with a control character (limits.PrintableName), as POST
// /v1/workers refuses a model with one: kvctl workers prints the model in
// a table, where a line break or a tab splits the rank's row, and log
// lines carry the model and tenant. A NUL among them would also make two
// namespaces one worker id (WorkerID joins model and tenant with one).
func checkPrintable(what, s string) error {
	if p := limits.PrintableName(s); p != "" {
		return badRequest("%s %s", what, p)
	}
	return checkName(what, s)
}

// checkID refuses an empty, overlong or non-printable id, as /v1 does:
// ids travel in URL paths and log lines, and key raftfsm's records.
func checkID(what, id string) error {
	if id == "" {
		return badRequest("%s is required", what)
	}
	if p := limits.ID(id); p != "" {
		return badRequest("%s %s", what, p)
	}
	return nil
}

// statusOK is the plain success answer.
var statusOK = StatusBody{Status: "ok"}

// ErrorBody is every error answer: {"error": "..."}.
type ErrorBody struct {
	Error string `json:"error"`
}

// StatusBody is a plain success answer: {"status": "ok"}.
type StatusBody struct {
	Status string `json:"status"`
}

// Map is a JSON object / MessagePack map with string keys, written with
// its keys sorted in both encodings (encoding/json sorts on its own; the
// MessagePack encoder sorts only some map types), so that equal answers
// are equal bytes.
type Map[V any] map[string]V

// EncodeMsgpack writes m with its keys in order.
func (m Map[V]) EncodeMsgpack(e *msgpack.Encoder) error {
	if m == nil {
		return e.EncodeNil()
	}
	if err := e.EncodeMapLen(len(m)); err != nil {
		return err
	}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if err := e.EncodeString(k); err != nil {
			return err
		}
		if err := e.Encode(m[k]); err != nil {
			return err
		}
	}
	return nil
}

// decodeBytesPerByte and decodeBytesFloor bound what a body's decode may
// allocate for its arrays and maps (decodeBudget): 16 bytes of memory per
// byte of the body, past a floor that small bodies stay under. A real
// body is far under it (a MessagePack hash of one byte decodes into 8, an
// event of 30 bytes into some 110); only arrays of nulls or empty values,
// which decode into nothing the router uses, go past.
const (
	decodeBytesPerByte = 16
	decodeBytesFloor   = 64 << 10
)

// decodeBudget is the memory a body of n bytes may decode into.
func decodeBudget(n int) uint64 {
	return decodeBytesPerByte*uint64(n) + decodeBytesFloor
}

// errDecodeBudget is the refusal of a body that would decode into more
// than budget bytes.
func errDecodeBudget(budget uint64) error {
	return fmt.Errorf("its arrays decode into more than %d bytes of memory (%d per byte of the body)", budget, decodeBytesPerByte)
}
