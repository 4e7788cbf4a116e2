package main

import (
	"fmt"
	"math/rand"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Workload settings: the keys rotate every KeyPeriod, so that each key's history is short enough
// for the linearizability search even with the unknown outcomes a fault leaves behind.
type Workload struct {
	Seeds     []string
	Seed      int64
	Workers   int
	Duration  time.Duration
	Timeout   time.Duration
	Think     time.Duration
	Registers int
	Counters  int
	KeyPeriod time.Duration
	// One more client overwrites BulkKeys keys in turn with BulkBytes-sized values, BulkRate a
	// second, so that the servers' logs keep needing new space (a full disk shows).
	BulkBytes int
	BulkRate  int
	BulkKeys  int
}

// bulkValue is the value of a bulk key: its id, padded to the size.
func bulkValue(id string, size int) string {
	if size <= len(id) {
		return id
	}
	return id + strings.Repeat("x", size-len(id))
}

// Edge keys and values: the empty key, binary keys, the longest key, empty, binary and
// the largest values, which every cluster path must carry as a standalone server does. The
// history names each by a short alias; the wire carries what it stands for.
const (
	keyMaxBytes   = 64 * 1024
	valueMaxBytes = 1 << 20
	// emptyKey is the alias of the empty key (a register, like every 'e' key).
	emptyKey = "e"
)

var everyByte = func() string {
	b := make([]byte, 256)
	for i := range b {
		b[i] = byte(i)
	}
	return string(b)
}()

// realKey is the key an alias stands for: "e" the empty key, "e...:b" a binary key holding
// every byte value, "e...:m" a key of the largest size; other keys stand for themselves.
func realKey(alias string) string {
	switch {
	case alias == emptyKey:
		return ""
	case keyKind(alias) == 'e' && strings.HasSuffix(alias, ":b"):
		return "\x00\xff\r\n" + alias + everyByte
	case keyKind(alias) == 'e' && strings.HasSuffix(alias, ":m"):
		return alias + strings.Repeat("m", keyMaxBytes-len(alias))
	}
	return alias
}

// realValue is the value an alias stands for: "X..." a binary value (the alias, a NUL, every
// byte value); other values (the empty one among them) stand for themselves.
func realValue(alias string) string {
	if strings.HasPrefix(alias, "X") {
		return alias + "\x00" + everyByte
	}
	return alias
}

// aliasOf is the alias of a value read back ("corrupt:..." when it is no value realValue makes).
func aliasOf(value string) string {
	nul := strings.IndexByte(value, 0)
	if nul < 0 {
		return value
	}
	if realValue(value[:nul]) == value {
		return value[:nul]
	}
	n := len(value)
	if n > 32 {
		n = 32
	}
	return fmt.Sprintf("corrupt:%q", value[:n])
}

// shrink replaces a value read back by what the history calls it: a bulk value by its id
// ("corrupt:..." when the padding is wrong), an edge value by its alias, so that the history
// stays small.
func shrink(key string, o *Op) {
	if o.Res != "ok" || o.Nil || o.F != "get" {
		return
	}
	if keyKind(key) == 'e' {
		o.Out = aliasOf(o.Out)
		return
	}
	if keyKind(key) != 'b' {
		return
	}
	dot := strings.IndexByte(o.Out, '.')
	if dot < 0 || bulkValue(o.Out[:dot+1], len(o.Out)) != o.Out {
		n := len(o.Out)
		if n > 32 {
			n = 32
		}
		o.Out = "corrupt:" + o.Out[:n]
		return
	}
	o.Out = o.Out[:dot+1]
}

// classify turns an outcome into the history's result for an operation `f`.
func classify(f string, out Outcome, o *Op) {
	switch {
	case out.Err != nil && !out.Sent:
		o.Res, o.Err = "fail", out.Err.Error()
	case out.Err != nil:
		o.Err = out.Err.Error()
		if isWrite(f) {
			o.Res = "info"
		} else {
			o.Res = "fail"
		}
	case out.Reply.Kind == '-':
		o.Err = out.Reply.Str
		word := strings.SplitN(out.Reply.Str, " ", 2)[0]
		switch {
		// Refusals made before a command runs: routing and availability.
		case word == "MOVED" || word == "ASK" || word == "TRYAGAIN" || word == "CLUSTERDOWN":
			o.Res = "fail"
		case isWrite(f):
			o.Res = "info"
		default:
			o.Res = "fail"
		}
	default:
		o.Res = "ok"
		r := out.Reply
		switch r.Kind {
		case ':':
			o.Out = strconv.FormatInt(r.Int, 10)
		case '$', '+':
			o.Out, o.Nil = r.Str, r.Nil
		default:
			o.Out = fmt.Sprintf("unexpected reply type %q", r.Kind)
		}
	}
}

// Run drives the load until the duration ends and returns every operation attempted.
func (w Workload) Run() []Op {
	slots := newSlots(w.Seeds)
	_ = slots.refresh(w.Timeout)
	start := time.Now()
	end := start.Add(w.Duration)
	var nextP atomic.Int64
	nextP.Store(int64(w.Workers))
	results := make([][]Op, w.Workers)
	var mu sync.Mutex
	var bulk []Op
	var wg sync.WaitGroup
	for i := 0; i < w.Workers; i++ {
		wg.Add(1)
		go func(worker int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(w.Seed*7919 + int64(worker)))
			c := newClient(slots, w.Timeout)
			defer c.closeAll()
			p := worker
			seq := 0
			written := []string{}
			var ops []Op
			for time.Now().Before(end) {
				seq++
				gen := int(time.Since(start) / w.KeyPeriod)
				o := Op{P: p}
				x := rng.Intn(100)
				switch {
				case x < 40:
					o.F, o.K = "get", fmt.Sprintf("r%d:%d", gen, rng.Intn(w.Registers))
				case x < 70:
					o.F, o.K = "set", fmt.Sprintf("r%d:%d", gen, rng.Intn(w.Registers))
					o.V = fmt.Sprintf("v%d.%d", worker, seq)
				case x < 75:
					o.F, o.K = "del", fmt.Sprintf("r%d:%d", gen, rng.Intn(w.Registers))
				case x < 85:
					o.F, o.K = "incr", fmt.Sprintf("c%d:%d", gen, rng.Intn(w.Counters))
				case x < 88:
					o.F, o.K = "get", fmt.Sprintf("c%d:%d", gen, rng.Intn(w.Counters))
				case x < 91:
					// An edge register: the empty key, a binary key or the longest key, with an
					// empty, a binary or a plain value.
					switch rng.Intn(4) {
					case 0:
						o.K = emptyKey
					case 1:
						o.K = fmt.Sprintf("e%d:b", gen)
					case 2:
						o.K = fmt.Sprintf("e%d:m", gen)
					default:
						o.K = fmt.Sprintf("e%d:%d", gen, rng.Intn(w.Registers))
					}
					switch y := rng.Intn(10); {
					case y < 4:
						o.F = "get"
					case y < 9:
						o.F = "set"
						switch seq % 3 {
						case 0:
							o.V = ""
						case 1:
							o.V = fmt.Sprintf("X%d.%d", worker, seq)
						default:
							o.V = fmt.Sprintf("v%d.%d", worker, seq)
						}
					default:
						o.F = "del"
					}
				case x < 97 || len(written) == 0:
					o.F, o.K = "set", fmt.Sprintf("s%d:%d", worker, seq)
					o.V = fmt.Sprintf("v%d.%d", worker, seq)
				default:
					j := rng.Intn(len(written))
					o.F, o.K = "del", written[j]
					written = append(written[:j], written[j+1:]...)
				}
				key := realKey(o.K)
				var args []string
				switch o.F {
				case "get":
					args = []string{"GET", key}
				case "set":
					args = []string{"SET", key, realValue(o.V)}
				case "del":
					args = []string{"DEL", key}
				case "incr":
					args = []string{"INCR", key}
				}
				o.T0 = time.Now().UnixNano()
				out := c.Do(key, args...)
				o.T1 = time.Now().UnixNano()
				classify(o.F, out, &o)
				shrink(o.K, &o)
				ops = append(ops, o)
				if o.F == "set" && o.K[0] == 's' && o.Res != "fail" {
					written = append(written, o.K)
				}
				switch o.Res {
				case "info":
					// A process whose last operation's outcome is unknown is retired: the
					// operation may still take effect at any later time.
					p = int(nextP.Add(1))
					time.Sleep(50 * time.Millisecond)
					_ = slots.refresh(w.Timeout)
				case "fail":
					time.Sleep(20 * time.Millisecond)
					_ = slots.refresh(w.Timeout)
				default:
					time.Sleep(w.Think)
				}
			}
			results[worker] = ops
		}(i)
	}
	if w.BulkRate > 0 && w.BulkBytes > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := newClient(slots, w.Timeout)
			defer c.closeAll()
			p := int(nextP.Add(1))
			var ops []Op
			tick := time.NewTicker(time.Second / time.Duration(w.BulkRate))
			defer tick.Stop()
			for n := 0; time.Now().Before(end); n++ {
				<-tick.C
				id := fmt.Sprintf("w%d.", n)
				size := w.BulkBytes
				if n%8 == 7 {
					// Now and then a value of the largest size a server takes.
					size = valueMaxBytes
				}
				o := Op{P: p, F: "set", K: fmt.Sprintf("b%d", n%w.BulkKeys), V: id, T0: time.Now().UnixNano()}
				out := c.Do(o.K, "SET", o.K, bulkValue(id, size))
				o.T1 = time.Now().UnixNano()
				classify(o.F, out, &o)
				ops = append(ops, o)
				if o.Res == "info" {
					p = int(nextP.Add(1))
				}
				if o.Res != "ok" {
					_ = slots.refresh(w.Timeout)
				}
			}
			mu.Lock()
			bulk = ops
			mu.Unlock()
		}()
	}
	wg.Wait()
	all := bulk
	for _, r := range results {
		all = append(all, r...)
	}
	return all
}

// Final reads every key of the history once the faults are over, retrying each until it is
// answered or the time runs out; the reads join the history (as new processes).
func Final(seeds []string, history []Op, timeout, limit time.Duration) ([]Op, []string) {
	slots := newSlots(seeds)
	_ = slots.refresh(timeout)
	keys := map[string]bool{}
	p := 0
	for _, o := range history {
		keys[o.K] = true
		if o.P > p {
			p = o.P
		}
	}
	c := newClient(slots, timeout)
	defer c.closeAll()
	deadline := time.Now().Add(limit)
	var ops []Op
	var unread []string
	for k := range keys {
		for {
			p++
			o := Op{P: p, F: "get", K: k, T0: time.Now().UnixNano()}
			out := c.Do(realKey(k), "GET", realKey(k))
			o.T1 = time.Now().UnixNano()
			classify("get", out, &o)
			shrink(k, &o)
			if o.Res == "ok" {
				ops = append(ops, o)
				break
			}
			if time.Now().After(deadline) {
				unread = append(unread, k+": "+o.Err)
				break
			}
			time.Sleep(50 * time.Millisecond)
			_ = slots.refresh(timeout)
		}
	}
	return ops, unread
}
