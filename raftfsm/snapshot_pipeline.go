package raftfsm

import (
	"encoding/binary"
	"math"
	"sync"

	"github.com/kvrouter/kvrouter/store"
)

// Restore's load is a pipeline. The caller reads, parses and hashes the
// stream into batches of records (key and value bytes back to back in one
// reusable buffer, no allocation per record); recWriters goroutines take
// the batches and write each as its own sstable (store.SortedTable), and
// the tables are ingested together. Parsing records in place in the read
// buffer, hashing many at a time, made the parse about four times cheaper;
// the sstable writing is the rest, and two writers share it over two cores.
//
// Errors come out as the one-goroutine loop gave them. A record is parsed
// before it is written, so an error writing record i comes before an error
// parsing any later record, the counts or the checksum: the error of the
// earliest failed batch wins, then the parser's. Each table checks that its
// first key follows the last key of the batch before it, so the key order
// is checked across batches as it was by one loader. Once a writer fails
// the parser stops, and batches after the failed one are not written.

const (
	recBatchBytes = 4 << 20 // a batch is handed over once it holds this many bytes
	recWriters    = 2       // goroutines writing tables
	recBatches    = 4       // batches in flight (parsed, being written, free)
)

// recBatch is a run of records and its place in the stream.
type recBatch struct {
	store.Records
	seq     int    // the batch's place in the stream, from 0; its table's number
	prev    []byte // the last key of the batches before it, if hasPrev
	hasPrev bool
}

// fill parses records into b until b is full or the stream's end marker
// (end true). A record wholly in the read buffer is parsed in place and
// its bytes hashed together with its neighbours'; anything else — a
// record across the buffer's end, or one the checks would refuse — goes
// through next, which reads it, or reports its error, exactly as ever.
// skip tells which records are counted but left out.
func (s *snapReader) fill(b *recBatch, skip func(kind byte) bool) (end bool, err error) {
	for b.Bytes() < recBatchBytes {
		if s.r.Buffered() < 4096 {
			s.r.Peek(4096) // refill; an error is found and reported by next
		}
		p, _ := s.r.Peek(s.r.Buffered())
		pos := 0
		for b.Bytes() < recBatchBytes {
			kl, n := binary.Uvarint(p[pos:])
			if n <= 0 || kl == 0 || kl > maxRecordKey {
				break
			}
			ks := pos + n
			ke := ks + int(kl)
			if ke >= len(p) || !store.ValidKind(p[ks]) {
				break
			}
			vl, m := binary.Uvarint(p[ke:])
			if m <= 0 || vl > maxRecordBytes {
				break
			}
			vs := ke + m
			ve := vs + int(vl)
			if ve > len(p) {
				break
			}
			kind := p[ks]
			s.got[kind]++
			if !skip(kind) {
				b.Add(p[ks:ke], p[vs:ve])
			}
			pos = ve
		}
		if pos > 0 {
			s.h.Write(p[:pos])
			s.n += int64(pos)
			s.r.Discard(pos)
		}
		if b.Bytes() >= recBatchBytes {
			break
		}
		// The next record is not wholly buffered, is the end marker, or is
		// refused: read it the careful way.
		k, v, err := s.next()
		if err != nil {
			return false, err
		}
		if k == nil {
			return true, nil
		}
		if !skip(k[0]) {
			b.Add(k, v)
		}
	}
	return false, nil
}

// loadRecords parses every record of s (after its header, up to the end
// marker) and writes those skip leaves in into ld, one table per batch,
// on recWriters goroutines; build, unless nil, is given each of them too
// (on the caller's goroutine, before the batch goes to a writer). It
// returns the first error in stream order; every goroutine it started has
// ended, and every table is closed, when it returns.
func loadRecords(s *snapReader, skip func(kind byte) bool, ld *store.SortedLoader, build *stateBuilder) error {
	free := make(chan *recBatch, recBatches)
	for i := 0; i < recBatches; i++ {
		b := &recBatch{}
		b.Grow(recBatchBytes + 64<<10)
		free <- b
	}
	full := make(chan *recBatch, recBatches)
	failed := make(chan struct{}) // closed when a writer fails
	var (
		mu       sync.Mutex
		failSeq  = math.MaxInt
		failErr  error
		failOnce sync.Once
	)
	firstFail := func() int {
		mu.Lock()
		defer mu.Unlock()
		return failSeq
	}
	var wg sync.WaitGroup
	for w := 0; w < recWriters; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := range full {
				// A batch after one that failed cannot change the result.
				if b.seq < firstFail() {
					if err := writeBatch(ld, b); err != nil {
						mu.Lock()
						if b.seq < failSeq {
							failSeq, failErr = b.seq, err
						}
						mu.Unlock()
						failOnce.Do(func() { close(failed) })
					}
				}
				b.Reset()
				free <- b // free has room for every batch: never blocks
			}
		}()
	}
	var (
		perr error
		prev []byte // the last key written, for the next batch's order check
		seq  int
	)
parse:
	for {
		var b *recBatch
		select {
		case b = <-free:
		case <-failed:
			break parse
		}
		end, err := s.fill(b, skip)
		if build != nil {
			_ = b.Each(build.add) // its error comes back from build.wait
		}
		if n := b.Len(); n > 0 {
			b.seq = seq
			seq++
			b.prev = append(b.prev[:0], prev...)
			b.hasPrev = seq > 1
			last, _ := b.At(n - 1)
			prev = append(prev[:0], last...)
			full <- b // full has room for every batch: never blocks
		} else {
			free <- b
		}
		if err != nil {
			perr = err
			break
		}
		if end {
			break
		}
	}
	close(full)
	wg.Wait()
	if failErr != nil {
		return failErr
	}
	return perr
}

// writeBatch writes a batch as one table, closing it whatever happens.
func writeBatch(ld *store.SortedLoader, b *recBatch) error {
	var after []byte
	if b.hasPrev {
		after = b.prev
	}
	t := ld.NewTable(b.seq, after)
	if err := b.Each(t.Set); err != nil {
		t.Close()
		return err
	}
	return t.Close()
}
