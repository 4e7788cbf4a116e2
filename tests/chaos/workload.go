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

// shrink replaces a bulk value read back by its id ("corrupt:..." when the padding is wrong), so
// that the history stays small.
func shrink(key string, o *Op) {
	if keyKind(key) != 'b' || o.Res != "ok" || o.Nil || o.F != "get" {
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
				case x < 97 || len(written) == 0:
					o.F, o.K = "set", fmt.Sprintf("s%d:%d", worker, seq)
					o.V = fmt.Sprintf("v%d.%d", worker, seq)
				default:
					j := rng.Intn(len(written))
					o.F, o.K = "del", written[j]
					written = append(written[:j], written[j+1:]...)
				}
				var args []string
				switch o.F {
				case "get":
					args = []string{"GET", o.K}
				case "set":
					args = []string{"SET", o.K, o.V}
				case "del":
					args = []string{"DEL", o.K}
				case "incr":
					args = []string{"INCR", o.K}
				}
				o.T0 = time.Now().UnixNano()
				out := c.Do(o.K, args...)
				o.T1 = time.Now().UnixNano()
				classify(o.F, out, &o)
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
				o := Op{P: p, F: "set", K: fmt.Sprintf("b%d", n%w.BulkKeys), V: id, T0: time.Now().UnixNano()}
				out := c.Do(o.K, "SET", o.K, bulkValue(id, w.BulkBytes))
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
			out := c.Do(k, "GET", k)
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
