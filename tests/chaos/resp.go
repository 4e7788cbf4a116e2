package main

// A minimal RESP2 cluster client for the workload: one connection per node, the slot map from
// CLUSTER SLOTS, MOVED and ASK followed. It never retries a command on its own: every attempt the
// workload makes is one entry of the history, so that a write sent twice is never recorded once.

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Reply is one RESP reply: Kind is '+', '-', ':', '$' or '*'; Nil marks a null bulk or array.
type Reply struct {
	Kind  byte
	Str   string
	Int   int64
	Nil   bool
	Elems []Reply
}

// maxBulk bounds what the reader accepts from a server: a reply larger than this is a protocol
// error, not an allocation.
const maxBulk = 64 << 20

type conn struct {
	c net.Conn
	r *bufio.Reader
	w *bufio.Writer
}

func dial(addr string, timeout time.Duration) (*conn, error) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, err
	}
	return &conn{c: c, r: bufio.NewReader(c), w: bufio.NewWriter(c)}, nil
}

func (c *conn) close() { _ = c.c.Close() }

// do sends one command and reads its reply before the deadline. An error means the connection
// is unusable (the command may or may not have run).
func (c *conn) do(deadline time.Time, args ...string) (Reply, error) {
	if err := c.c.SetDeadline(deadline); err != nil {
		return Reply{}, err
	}
	fmt.Fprintf(c.w, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(c.w, "$%d\r\n%s\r\n", len(a), a)
	}
	if err := c.w.Flush(); err != nil {
		return Reply{}, err
	}
	return readReply(c.r, 0)
}

func readLine(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	if !strings.HasSuffix(line, "\r\n") {
		return "", errors.New("protocol error: line without CRLF")
	}
	return line[:len(line)-2], nil
}

func readReply(r *bufio.Reader, depth int) (Reply, error) {
	if depth > 8 {
		return Reply{}, errors.New("protocol error: replies nested too deep")
	}
	line, err := readLine(r)
	if err != nil {
		return Reply{}, err
	}
	if line == "" {
		return Reply{}, errors.New("protocol error: empty line")
	}
	kind, rest := line[0], line[1:]
	switch kind {
	case '+', '-':
		return Reply{Kind: kind, Str: rest}, nil
	case ':':
		n, err := strconv.ParseInt(rest, 10, 64)
		if err != nil {
			return Reply{}, fmt.Errorf("protocol error: integer %q", rest)
		}
		return Reply{Kind: kind, Int: n}, nil
	case '$':
		n, err := strconv.Atoi(rest)
		if err != nil || n < -1 || n > maxBulk {
			return Reply{}, fmt.Errorf("protocol error: bulk length %q", rest)
		}
		if n == -1 {
			return Reply{Kind: kind, Nil: true}, nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return Reply{}, err
		}
		if buf[n] != '\r' || buf[n+1] != '\n' {
			return Reply{}, errors.New("protocol error: bulk without CRLF")
		}
		return Reply{Kind: kind, Str: string(buf[:n])}, nil
	case '*':
		n, err := strconv.Atoi(rest)
		if err != nil || n < -1 || n > 1<<20 {
			return Reply{}, fmt.Errorf("protocol error: array length %q", rest)
		}
		if n == -1 {
			return Reply{Kind: kind, Nil: true}, nil
		}
		out := Reply{Kind: kind, Elems: make([]Reply, 0, n)}
		for i := 0; i < n; i++ {
			e, err := readReply(r, depth+1)
			if err != nil {
				return Reply{}, err
			}
			out.Elems = append(out.Elems, e)
		}
		return out, nil
	}
	return Reply{}, fmt.Errorf("protocol error: reply type %q", kind)
}

// crc16 is the XMODEM CRC that Redis Cluster hashes keys with.
func crc16(b []byte) uint16 {
	var crc uint16
	for _, c := range b {
		crc ^= uint16(c) << 8
		for i := 0; i < 8; i++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// keySlot is the key's hash slot, hash tags included.
func keySlot(key string) int {
	if s := strings.IndexByte(key, '{'); s >= 0 {
		if e := strings.IndexByte(key[s+1:], '}'); e > 0 {
			key = key[s+1 : s+1+e]
		}
	}
	return int(crc16([]byte(key)) % 16384)
}

// Slots is the slot map shared by a run's workers, refreshed from CLUSTER SLOTS.
type Slots struct {
	mu    sync.Mutex
	seeds []string
	owner [16384]string
}

func newSlots(seeds []string) *Slots {
	s := &Slots{seeds: seeds}
	for i := range s.owner {
		s.owner[i] = seeds[i%len(seeds)]
	}
	return s
}

func (s *Slots) get(slot int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.owner[slot]
}

func (s *Slots) set(slot int, addr string) {
	s.mu.Lock()
	s.owner[slot] = addr
	s.mu.Unlock()
}

// refresh asks the seeds, in turn, for CLUSTER SLOTS and takes the first answer.
func (s *Slots) refresh(timeout time.Duration) error {
	var last error = errors.New("no seed")
	for _, seed := range s.seeds {
		c, err := dial(seed, timeout)
		if err != nil {
			last = err
			continue
		}
		r, err := c.do(time.Now().Add(timeout), "CLUSTER", "SLOTS")
		c.close()
		if err != nil {
			last = err
			continue
		}
		if r.Kind != '*' {
			last = fmt.Errorf("CLUSTER SLOTS: %s", r.Str)
			continue
		}
		s.mu.Lock()
		for _, rg := range r.Elems {
			if len(rg.Elems) < 3 || len(rg.Elems[2].Elems) < 2 {
				continue
			}
			lo, hi := int(rg.Elems[0].Int), int(rg.Elems[1].Int)
			m := rg.Elems[2].Elems
			addr := net.JoinHostPort(m[0].Str, strconv.FormatInt(m[1].Int, 10))
			for i := lo; i <= hi && i < 16384; i++ {
				if i >= 0 {
					s.owner[i] = addr
				}
			}
		}
		s.mu.Unlock()
		return nil
	}
	return last
}

// Client is one worker's connections.
type Client struct {
	slots   *Slots
	conns   map[string]*conn
	timeout time.Duration
}

func newClient(slots *Slots, timeout time.Duration) *Client {
	return &Client{slots: slots, conns: map[string]*conn{}, timeout: timeout}
}

func (c *Client) drop(addr string) {
	if cn, ok := c.conns[addr]; ok {
		cn.close()
		delete(c.conns, addr)
	}
}

func (c *Client) closeAll() {
	for a := range c.conns {
		c.drop(a)
	}
}

// Outcome of one command: a reply, or Err when the connection failed after the command may
// have been sent (Sent tells whether it could have been).
type Outcome struct {
	Reply Reply
	Err   error
	Sent  bool
}

// Do runs one command on the key's master, following up to 5 redirects (a MOVED or ASK reply
// means the command did not run there).
func (c *Client) Do(key string, args ...string) Outcome {
	slot := keySlot(key)
	addr := c.slots.get(slot)
	asking := false
	for hop := 0; ; hop++ {
		cn, ok := c.conns[addr]
		if !ok {
			var err error
			cn, err = dial(addr, c.timeout)
			if err != nil {
				_ = c.slots.refresh(c.timeout)
				return Outcome{Err: err}
			}
			c.conns[addr] = cn
		}
		deadline := time.Now().Add(c.timeout)
		if asking {
			if r, err := cn.do(deadline, "ASKING"); err != nil || r.Kind == '-' {
				c.drop(addr)
				return Outcome{Err: fmt.Errorf("ASKING: %v %s", err, r.Str)}
			}
		}
		r, err := cn.do(deadline, args...)
		if err != nil {
			c.drop(addr)
			return Outcome{Err: err, Sent: true}
		}
		if r.Kind == '-' && hop < 5 {
			f := strings.Fields(r.Str)
			if len(f) == 3 && (f[0] == "MOVED" || f[0] == "ASK") {
				addr = f[2]
				asking = f[0] == "ASK"
				if f[0] == "MOVED" {
					c.slots.set(slot, addr)
				}
				continue
			}
		}
		return Outcome{Reply: r, Sent: true}
	}
}
