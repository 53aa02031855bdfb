package store

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
)

// StateSnapshot is a consistent read view of the whole database, for
// streaming a Raft snapshot while applies go on. Close it always: an open
// Pebble snapshot holds back compaction.
//
// Reading a view (Each) is most of a snapshot save's work: Pebble's
// merging iterator over a level 0 of up to stateL0CompactionSubs
// sublevels, each a group table that spans the whole keyspace, took 2.6 s
// of a 3.8 s profile of saving 5M blocks, on one core. So Each reads the
// view in parts on several goroutines and hands the records to its caller
// in key order (see Each).
type StateSnapshot struct {
	s    *StateDB
	snap *pebble.Snapshot // nil once the view or its database is closed
	over []byte           // writes laid over snap, as StateBatch.gather lays them out (StateBatch.View)

	reading bool                   // an Each runs
	its     map[*viewIter]struct{} // the running Each's open iterators
}

// viewIter is an Each reader's iterator. Its reader holds mu while it
// reads a chunk, and not viewMu, so that readers run side by side; a
// close of the view (viewMu held) takes mu to close it under the reader.
type viewIter struct {
	mu sync.Mutex
	it *pebble.Iterator // nil once closed
}

// close closes the iterator (mu held); a second close does nothing.
func (vi *viewIter) close() error {
	if vi.it == nil {
		return nil
	}
	err := vi.it.Close()
	vi.it = nil
	return err
}

// Snapshot opens a read view.
func (s *StateDB) Snapshot() *StateSnapshot { return s.newView(nil) }

func (s *StateDB) newView(over []byte) *StateSnapshot {
	v := &StateSnapshot{s: s, over: over, its: make(map[*viewIter]struct{})}
	s.viewMu.Lock()
	defer s.viewMu.Unlock()
	if s.closing {
		return v // closed: its reads fail with ErrClosed
	}
	v.snap = s.db.NewSnapshot()
	if s.views == nil {
		s.views = make(map[*StateSnapshot]struct{})
	}
	s.views[v] = struct{}{}
	return v
}

// release closes the view's iterators and snapshot (viewMu held).
func (v *StateSnapshot) release() error {
	var err error
	for vi := range v.its {
		vi.mu.Lock()
		if cerr := vi.close(); err == nil {
			err = cerr
		}
		vi.mu.Unlock()
		delete(v.its, vi)
	}
	if v.snap != nil {
		if cerr := v.snap.Close(); err == nil {
			err = cerr
		}
		v.snap = nil
	}
	delete(v.s.views, v)
	return err
}

var (
	errViewClosed  = fmt.Errorf("read view: %w", ErrClosed)
	errViewReading = errors.New("read view: already being read")
)

// Applied reads the applied index and term of the view. A closed view
// (or one whose database closed) fails with ErrClosed, as Each does, even
// when its overlay holds the answer.
func (v *StateSnapshot) Applied() (uint64, uint64, error) {
	v.s.viewMu.Lock()
	defer v.s.viewMu.Unlock()
	if v.snap == nil {
		return 0, 0, errViewClosed
	}
	// The applied record's kind sorts first: if the overlay has it, it is
	// the overlay's first write.
	if len(v.over) > 0 {
		if k, val, del, _ := nextGathered(v.over); bytes.Equal(k, appliedKey) {
			if del {
				return 0, 0, nil
			}
			return DecodeApplied(val)
		}
	}
	return readApplied(v.snap)
}

// Close releases the view; after its database closed, it does nothing.
func (v *StateSnapshot) Close() error {
	v.s.viewMu.Lock()
	defer v.s.viewMu.Unlock()
	return v.release()
}

// How Each reads (variables so that tests can make many small parts and
// chunks of a small view):
//
//   - viewChunkBytes: a reader copies records out of the database a chunk
//     of about this many bytes at a time, under its iterator's lock.
//   - viewPartBytes: the keyspace is cut into parts of about this many
//     bytes of tables (Pebble's estimate); one reader reads a part.
//   - viewMaxParts: at most this many parts (a range that Pebble
//     estimates at one data block or more, however small, is cut again).
//   - viewReaders: at most this many readers (and no more than GOMAXPROCS).
//   - viewWindow: a reader starts a part only while fewer than this many
//     parts are read or being read and not yet handed to fn; a part's
//     chunks wait in full for fn, so the records held ahead are at most
//     about viewWindow parts.
var (
	viewChunkBytes = 1 << 20
	viewPartBytes  = uint64(4 << 20)
	viewMaxParts   = 1 << 12
	viewReaders    = 4
	viewWindow     = 4
)

// viewReaderOpened, when set (tests), runs in a reader between opening
// its iterator and first using it.
var viewReaderOpened func()

// viewIterForgotten, when set (tests), runs in a reader that is done with
// its part, between forgetting its iterator and closing it.
var viewIterForgotten func()

// Each calls fn for every record of the view in key order (the full key,
// kind byte first), on the caller's goroutine. The slices are valid only
// during the call. One Each at a time: another, while one runs, fails.
//
// How: the keyspace is cut into parts (StateSnapshot.parts), readers
// take the parts in key order, each part through an iterator of its own
// on the view's snapshot, with the overlay's writes of the part merged
// in, and copy the records out a chunk at a time; fn gets the parts'
// chunks in order. A chunk is read under its reader's iterator lock and
// fn runs without any lock, so that closing the database never waits for
// fn (a slow reader of a user's save, Raft's snapshot sink): Close closes
// the readers' iterators, and Each then fails with ErrClosed. When fn
// fails, the readers stop and Each returns fn's error once they have; when
// fn panics, they stop before the panic goes on up.
func (v *StateSnapshot) Each(fn func(key, value []byte) error) error {
	mu := &v.s.viewMu
	mu.Lock()
	if v.snap == nil {
		mu.Unlock()
		return errViewClosed
	}
	if v.reading {
		mu.Unlock()
		return errViewReading
	}
	v.reading = true
	parts := v.parts([]byte{KindApplied}, []byte{kindEnd})
	mu.Unlock()
	defer func() {
		mu.Lock()
		v.reading = false
		mu.Unlock()
	}()

	readers := min(viewReaders, runtime.GOMAXPROCS(0), len(parts))
	window := make(chan struct{}, max(viewWindow, readers))
	rd := &viewRead{stop: make(chan struct{}), free: make(chan *Records, cap(window)*cap(parts[0].chunks)+readers)}
	var next atomic.Int64
	var wg sync.WaitGroup
	// Deferred, so that a panic in fn (which net/http, for one, recovers)
	// still stops the readers and closes their iterators.
	defer func() {
		close(rd.stop)
		wg.Wait()
	}()
	for range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case window <- struct{}{}:
				case <-rd.stop:
					return
				}
				i := int(next.Add(1)) - 1
				if i >= len(parts) {
					return // its window place is never given back: none is needed
				}
				v.readPart(parts[i], rd)
			}
		}()
	}
	var err error
	for _, p := range parts {
		for c := range p.chunks {
			if err = c.Each(fn); err != nil {
				break
			}
			select {
			case rd.free <- c:
			default:
			}
		}
		if err == nil {
			err = p.err // the channel closed: the reader is done with p
		}
		if err != nil {
			break
		}
		<-window
	}
	return err
}

// viewRead is what an Each's readers share.
type viewRead struct {
	stop chan struct{} // closed when Each returns: the readers give up
	free chan *Records // chunks fn is done with, for the readers to reuse
}

// chunk returns an empty chunk.
func (rd *viewRead) chunk() *Records {
	select {
	case c := <-rd.free:
		c.Reset()
		return c
	default:
		c := new(Records)
		c.Grow(viewChunkBytes + viewChunkBytes/8)
		return c
	}
}

// viewPart is a range of a view's keyspace that one reader reads.
type viewPart struct {
	lo, hi []byte
	over   []byte        // the overlay's writes in [lo, hi)
	chunks chan *Records // closed when the part is read (or given up)
	err    error         // why the part was given up; read after chunks closes
}

// parts cuts the view's keyspace [lower, upper) into parts (viewMu
// held, the view open). The cuts only balance the readers' work: any
// cuts read the same records.
func (v *StateSnapshot) parts(lower, upper []byte) []*viewPart {
	cuts := [][]byte{lower}
	v.s.cutRange(lower, upper, viewPartBytes, 0, &cuts)
	cuts = append(cuts, upper)
	// A part's chunks wait for fn in full (Each), so its channel holds
	// them all; a part larger than the estimate holds its reader back.
	perPart := int(viewPartBytes/uint64(viewChunkBytes)) + 2
	parts := make([]*viewPart, len(cuts)-1)
	over := v.over
	for len(over) > 0 {
		if k, _, _, rest := nextGathered(over); bytes.Compare(k, lower) < 0 {
			over = rest // not a record of the view
			continue
		}
		break
	}
	for i := range parts {
		p := &viewPart{lo: cuts[i], hi: cuts[i+1], chunks: make(chan *Records, perPart)}
		// The overlay is sorted: its writes below hi come next.
		rest := over
		for len(rest) > 0 {
			k, _, _, r := nextGathered(rest)
			if bytes.Compare(k, p.hi) >= 0 {
				break
			}
			rest = r
		}
		p.over = over[:len(over)-len(rest)]
		over = rest
		parts[i] = p
	}
	return parts
}

// maxCutDepth bounds cutRange's halvings of one range: 8 per byte of
// key (a residency's key is 21 bytes).
const maxCutDepth = 8 * 24

// cutRange appends to cuts the keys that cut [lo, hi) into ranges of
// about partBytes of tables each, in key order. It halves a range by the
// numeric midpoint of its bounds until Pebble estimates a range at
// partBytes or less: the state's keys are mostly random hashes below a
// kind (and rank) prefix, so the halves of the halves even out.
func (s *StateDB) cutRange(lo, hi []byte, partBytes uint64, depth int, cuts *[][]byte) {
	if depth >= maxCutDepth || len(*cuts) >= viewMaxParts {
		return
	}
	size, err := s.db.EstimateDiskUsage(lo, hi)
	if err != nil || size <= partBytes {
		return
	}
	mid := midKey(lo, hi)
	if bytes.Compare(mid, lo) <= 0 || bytes.Compare(mid, hi) >= 0 {
		return
	}
	s.cutRange(lo, mid, partBytes, depth+1, cuts)
	if len(*cuts) >= viewMaxParts {
		return
	}
	*cuts = append(*cuts, mid)
	s.cutRange(mid, hi, partBytes, depth+1, cuts)
}

// midKey returns a key between lo and hi (lo < hi), about halfway when
// both are read as big-endian numbers of the same length (the shorter
// padded with zeros, plus one byte so that adjacent keys have a middle).
// Keys that differ only in trailing zeros have no middle: it returns lo.
func midKey(lo, hi []byte) []byte {
	n := max(len(lo), len(hi)) + 1
	a, b := make([]byte, n), make([]byte, n)
	copy(a, lo)
	copy(b, hi)
	// (a + b) / 2, from the last byte to the first, then the halving from
	// the first to the last.
	sum := make([]byte, n)
	carry := 0
	for i := n - 1; i >= 0; i-- {
		t := int(a[i]) + int(b[i]) + carry
		sum[i], carry = byte(t), t>>8
	}
	for i := 0; i < n; i++ {
		t := carry<<8 | int(sum[i])
		sum[i], carry = byte(t>>1), t&1
	}
	return bytes.TrimRight(sum, "\x00")
}

// readPart reads one part into its chunks and closes them. It gives up
// when the view closes (ErrClosed) or Each stops it.
func (v *StateSnapshot) readPart(p *viewPart, rd *viewRead) {
	defer close(p.chunks)
	select {
	case <-rd.stop:
		return // Each is done: no one reads this part
	default:
	}
	mu := &v.s.viewMu
	mu.Lock()
	if v.snap == nil {
		mu.Unlock()
		p.err = errViewClosed
		return
	}
	it, err := v.snap.NewIter(&pebble.IterOptions{LowerBound: p.lo, UpperBound: p.hi})
	if err != nil {
		mu.Unlock()
		p.err = fmt.Errorf("iterate state snapshot: %w", err)
		return
	}
	vi := &viewIter{it: it}
	v.its[vi] = struct{}{}
	mu.Unlock()
	if viewReaderOpened != nil {
		viewReaderOpened()
	}
	// done forgets the iterator and closes it, unless the view's close did,
	// under viewMu throughout (release's lock order: viewMu, then vi.mu): a
	// StateDB.Close between the two would find no iterator to close and
	// close the database under an open one.
	done := func() error {
		mu.Lock()
		defer mu.Unlock()
		delete(v.its, vi)
		if viewIterForgotten != nil {
			viewIterForgotten()
		}
		vi.mu.Lock()
		defer vi.mu.Unlock()
		return vi.close()
	}
	vi.mu.Lock()
	if vi.it == nil {
		vi.mu.Unlock()
		p.err = errViewClosed // the view closed since the iterator opened
		return
	}
	valid := it.First()
	vi.mu.Unlock()
	over := p.over
	for {
		c := rd.chunk()
		vi.mu.Lock()
		if vi.it == nil {
			vi.mu.Unlock()
			p.err = errViewClosed // the database closed under the view
			return
		}
		for c.Bytes() < viewChunkBytes && (valid || len(over) > 0) {
			if len(over) > 0 {
				k, val, del, rest := nextGathered(over)
				cmp := -1
				if valid {
					cmp = bytes.Compare(k, it.Key())
				}
				if cmp <= 0 {
					// The overlay's write comes first, or replaces the
					// database's record of the same key.
					over = rest
					if cmp == 0 {
						valid = it.Next()
					}
					if !del {
						c.Add(k, val)
					}
					continue
				}
			}
			c.Add(it.Key(), it.Value())
			valid = it.Next()
		}
		var ierr error
		if !valid {
			ierr = it.Error() // read before a close can drop it
		}
		vi.mu.Unlock()
		if ierr != nil {
			_ = done()
			p.err = fmt.Errorf("iterate state snapshot: %w", ierr)
			return
		}
		last := !valid && len(over) == 0
		if last {
			if err := done(); err != nil {
				p.err = fmt.Errorf("iterate state snapshot: %w", err)
			}
		}
		if c.Len() > 0 {
			select {
			case p.chunks <- c:
			case <-rd.stop:
				if !last {
					_ = done()
				}
				return
			}
		}
		if last {
			return
		}
	}
}
