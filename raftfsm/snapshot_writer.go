package raftfsm

import (
	"hash"
	"io"
	"sync"
)

// blockWriter is the snapshot writer's output: the stream is encoded into
// blocks of about snapWriteBlock bytes, and a goroutine of its own writes
// each block to the sink and hashes it, so that the writing and the
// hashing overlap the scan of the state database (in a profile of the
// 5M-block save, writing and hashing were about a quarter of its CPU,
// after the scan each time).
//
// The caller appends to buf and calls flush when it is full; finish sends
// the rest and waits. After a write error, every later flush drops its
// block and finish returns the error.
type blockWriter struct {
	buf  []byte // the block being encoded
	full chan []byte
	free chan []byte
	done chan struct{}

	w   io.Writer
	h   hash.Hash
	n   int64 // bytes written, read after done
	mu  sync.Mutex
	err error
}

const (
	snapWriteBlock  = 1 << 20
	snapWriteBlocks = 4 // blocks in flight (encoded, being written, free)
)

func newBlockWriter(w io.Writer, h hash.Hash) *blockWriter {
	bw := &blockWriter{
		full: make(chan []byte, snapWriteBlocks),
		free: make(chan []byte, snapWriteBlocks),
		done: make(chan struct{}),
		w:    w,
		h:    h,
	}
	for i := 0; i < snapWriteBlocks-1; i++ {
		bw.free <- make([]byte, 0, snapWriteBlock+64<<10)
	}
	bw.buf = make([]byte, 0, snapWriteBlock+64<<10)
	go bw.run()
	return bw
}

func (bw *blockWriter) run() {
	defer close(bw.done)
	for b := range bw.full {
		if bw.failed() == nil {
			bw.h.Write(b)
			n, err := bw.w.Write(b)
			bw.n += int64(n)
			if err == nil && n < len(b) {
				err = io.ErrShortWrite
			}
			if err != nil {
				bw.mu.Lock()
				bw.err = err
				bw.mu.Unlock()
			}
		}
		bw.free <- b[:0] // free has room for every block: never blocks
	}
}

func (bw *blockWriter) failed() error {
	bw.mu.Lock()
	defer bw.mu.Unlock()
	return bw.err
}

// flush hands buf to the writing goroutine and takes an empty block. It
// returns the goroutine's write error, if one happened.
func (bw *blockWriter) flush() error {
	if err := bw.failed(); err != nil {
		bw.buf = bw.buf[:0]
		return err
	}
	bw.full <- bw.buf
	bw.buf = <-bw.free
	return nil
}

// finish writes the rest, waits for every block to be written and
// returns the bytes written and the first write error. The blockWriter
// is done with afterwards.
func (bw *blockWriter) finish() (int64, error) {
	if len(bw.buf) > 0 {
		bw.flush()
	}
	close(bw.full)
	<-bw.done
	return bw.n, bw.failed()
}
