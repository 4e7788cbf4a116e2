package main

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// state of one key in the model: absent, or a value (a counter's value is its decimal text).
type state struct {
	present bool
	v       string
}

type input struct{ f, v string }

type output struct {
	unknown bool
	nil     bool
	out     string
}

// kvModel is a single key under GET, SET, DEL and INCR with Redis's replies. An operation whose
// outcome is unknown may have taken effect at any point after its invocation, or never.
var kvModel = porcupine.Model{
	Init: func() interface{} { return state{} },
	Step: func(st, in, out interface{}) (bool, interface{}) {
		s, i, o := st.(state), in.(input), out.(output)
		switch i.f {
		case "get":
			if o.unknown {
				return true, s
			}
			if o.nil {
				return !s.present, s
			}
			return s.present && s.v == o.out, s
		case "set":
			return o.unknown || o.out == "OK", state{true, i.v}
		case "del":
			if o.unknown {
				return true, state{}
			}
			want := "0"
			if s.present {
				want = "1"
			}
			return o.out == want, state{}
		case "incr":
			cur := int64(0)
			if s.present {
				n, err := strconv.ParseInt(s.v, 10, 64)
				if err != nil {
					// INCR of a value that is not an integer changes nothing.
					return o.unknown, s
				}
				cur = n
			}
			next := strconv.FormatInt(cur+1, 10)
			return o.unknown || o.out == next, state{true, next}
		}
		return false, s
	},
	DescribeOperation: func(in, out interface{}) string {
		i, o := in.(input), out.(output)
		r := o.out
		switch {
		case o.unknown:
			r = "unknown"
		case o.nil:
			r = "nil"
		}
		if i.v != "" {
			return fmt.Sprintf("%s(%s) -> %s", i.f, i.v, r)
		}
		return fmt.Sprintf("%s -> %s", i.f, r)
	},
	DescribeState: func(st interface{}) string {
		s := st.(state)
		if !s.present {
			return "absent"
		}
		return s.v
	},
}

// Violation is one broken promise, with the key's operations around it.
type Violation struct {
	Key     string   `json:"key"`
	What    string   `json:"what"`
	History []string `json:"history"`
	File    string   `json:"visualization,omitempty"`
}

// Result of checking one history.
type Result struct {
	Mode        string         `json:"mode"`
	Ops         map[string]int `json:"operations"`
	Keys        int            `json:"keys"`
	Linearized  int            `json:"keys_linearizable"`
	Undecided   []string       `json:"keys_undecided"`
	Violations  []Violation    `json:"violations"`
	AsyncLosses map[string]int `json:"async_losses,omitempty"`
}

// toPorcupine converts one key's operations: failed ones are left out (they did not run), unknown
// ones stay open until after the last completion of the whole history.
func toPorcupine(ops []Op, end int64) []porcupine.Operation {
	var out []porcupine.Operation
	for _, o := range ops {
		if o.Res == "fail" {
			continue
		}
		ret := o.T1
		if o.Res == "info" {
			ret = end
		}
		out = append(out, porcupine.Operation{
			ClientId: o.P,
			Input:    input{o.F, o.V},
			Output:   output{unknown: o.Res == "info", nil: o.Nil, out: o.Out},
			Call:     o.T0,
			Return:   ret,
		})
	}
	return out
}

// around lists the key's operations near time t (at most n of them).
func around(ops []Op, t int64, n int) []string {
	sort.SliceStable(ops, func(i, j int) bool { return ops[i].T0 < ops[j].T0 })
	at := sort.Search(len(ops), func(i int) bool { return ops[i].T0 >= t })
	lo, hi := at-n/2, at+n/2
	if lo < 0 {
		lo = 0
	}
	if hi > len(ops) {
		hi = len(ops)
	}
	base := ops[0].T0
	var lines []string
	for _, o := range ops[lo:hi] {
		lines = append(lines, fmt.Sprintf("%10.3fms %10.3fms  %s", float64(o.T0-base)/1e6, float64(o.T1-base)/1e6, o))
	}
	return lines
}

// Check verifies a history against the mode's promise; `dir`, if not empty, receives a
// visualization of each key that is not linearizable.
func Check(mode string, ops []Op, perKey time.Duration, dir string) Result {
	res := Result{Mode: mode, Ops: map[string]int{}, Undecided: []string{}, Violations: []Violation{}}
	var end int64
	for _, o := range ops {
		res.Ops[o.F+"_"+o.Res]++
		if o.T1 > end {
			end = o.T1
		}
	}
	end++
	keys := byKey(ops)
	res.Keys = len(keys)
	if mode == "async" {
		checkAsync(keys, &res)
		return res
	}
	names := make([]string, 0, len(keys))
	for k := range keys {
		names = append(names, k)
	}
	sort.Strings(names)
	var mu sync.Mutex
	var wg sync.WaitGroup
	work := make(chan string)
	for w := 0; w < runtime.NumCPU(); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range work {
				hist := toPorcupine(keys[k], end)
				r, info := porcupine.CheckOperationsVerbose(kvModel, hist, perKey)
				mu.Lock()
				switch r {
				case porcupine.Ok:
					res.Linearized++
				case porcupine.Unknown:
					res.Undecided = append(res.Undecided, k)
				case porcupine.Illegal:
					v := Violation{Key: k, What: "not linearizable"}
					// The first operation (by invocation) outside the longest partial
					// linearization is where the history cannot be explained.
					at := firstUnexplained(hist, info)
					v.History = around(keys[k], at, 40)
					if dir != "" {
						f := filepath.Join(dir, "violation-"+strings.ReplaceAll(k, ":", "_")+".html")
						if porcupine.VisualizePath(kvModel, info, f) == nil {
							v.File = f
						}
					}
					res.Violations = append(res.Violations, v)
				}
				mu.Unlock()
			}
		}()
	}
	for _, k := range names {
		work <- k
	}
	close(work)
	wg.Wait()
	checkSets(keys, &res, false)
	sort.Slice(res.Violations, func(i, j int) bool { return res.Violations[i].Key < res.Violations[j].Key })
	sort.Strings(res.Undecided)
	return res
}

func firstUnexplained(hist []porcupine.Operation, info porcupine.LinearizationInfo) int64 {
	best := []int{}
	for _, part := range info.PartialLinearizations() {
		for _, lin := range part {
			if len(lin) > len(best) {
				best = lin
			}
		}
	}
	in := map[int]bool{}
	for _, i := range best {
		in[i] = true
	}
	at := int64(-1)
	for i, o := range hist {
		if !in[i] && (at < 0 || o.Call < at) {
			at = o.Call
		}
	}
	return at
}

// finalRead is the last successful read of a key (the final reads come last).
func finalRead(ops []Op) (Op, bool) {
	for i := len(ops) - 1; i >= 0; i-- {
		if ops[i].F == "get" && ops[i].Res == "ok" {
			return ops[i], true
		}
	}
	return Op{}, false
}

// checkSets: every acknowledged write present at the end, no deleted key back, counters neither
// lost nor doubled. With `lossAllowed` (async), lost writes are counted instead of reported.
func checkSets(keys map[string][]Op, res *Result, lossAllowed bool) {
	loss := func(kind string) {
		if res.AsyncLosses == nil {
			res.AsyncLosses = map[string]int{}
		}
		res.AsyncLosses[kind]++
	}
	for k, ops := range keys {
		last, ok := finalRead(ops)
		if !ok {
			continue
		}
		bad := func(what string) {
			res.Violations = append(res.Violations, Violation{Key: k, What: what, History: around(ops, last.T0, 30)})
		}
		switch keyKind(k) {
		case 's':
			var set, del *Op
			for i := range ops {
				switch ops[i].F {
				case "set":
					set = &ops[i]
				case "del":
					del = &ops[i]
				}
			}
			switch {
			case del != nil && del.Res == "ok" && !last.Nil:
				if lossAllowed {
					loss("deleted_key_back")
				} else {
					bad("a deleted key came back: " + last.Out)
				}
			case set != nil && set.Res == "ok" && del == nil && last.Nil:
				if lossAllowed {
					loss("acknowledged_write_missing")
				} else {
					bad("an acknowledged write is missing")
				}
			case !last.Nil && (set == nil || last.Out != set.V):
				bad("a value nobody wrote: " + last.Out)
			}
		case 'c':
			var acked, unknown int64
			for _, o := range ops {
				if o.F == "incr" && o.Res == "ok" {
					acked++
				} else if o.F == "incr" && o.Res == "info" {
					unknown++
				}
			}
			var n int64
			if !last.Nil {
				v, err := strconv.ParseInt(last.Out, 10, 64)
				if err != nil {
					bad("a counter that is not an integer: " + last.Out)
					continue
				}
				n = v
			}
			switch {
			case n > acked+unknown:
				bad(fmt.Sprintf("a counter doubled increments: %d, with %d acknowledged and %d unknown", n, acked, unknown))
			case n < acked && lossAllowed:
				loss("counter_increments_lost")
			case n < acked:
				bad(fmt.Sprintf("a counter lost increments: %d, with %d acknowledged", n, acked))
			}
		}
	}
}

// checkAsync: the promise of `async` tables. An acknowledged write may be lost with its master
// (what was in flight to the backups); nothing else is allowed: every value read was written to
// that key by an operation invoked before the read returned, and a counter never counts an
// increment twice.
func checkAsync(keys map[string][]Op, res *Result) {
	for k, ops := range keys {
		for _, r := range ops {
			if r.F != "get" || r.Res != "ok" || r.Nil {
				continue
			}
			ok := false
			switch keyKind(k) {
			case 'c':
				n, err := strconv.ParseInt(r.Out, 10, 64)
				var invoked int64
				for _, o := range ops {
					if o.F == "incr" && o.Res != "fail" && o.T0 <= r.T1 {
						invoked++
					}
				}
				ok = err == nil && n >= 1 && n <= invoked
			default:
				for _, o := range ops {
					if o.F == "set" && o.Res != "fail" && o.T0 <= r.T1 && o.V == r.Out {
						ok = true
						break
					}
				}
			}
			if !ok {
				res.Violations = append(res.Violations, Violation{Key: k, What: "read a value never written (or not yet written): " + r.Out, History: around(ops, r.T0, 30)})
			}
		}
	}
	checkSets(keys, res, true)
	sort.Slice(res.Violations, func(i, j int) bool { return res.Violations[i].Key < res.Violations[j].Key })
}

// writeReport prints the result as text.
func writeReport(w *os.File, r Result) {
	fmt.Fprintf(w, "mode %s: %d keys, %d linearizable, %d undecided, %d violations\n", r.Mode, r.Keys, r.Linearized, len(r.Undecided), len(r.Violations))
	kinds := make([]string, 0, len(r.Ops))
	for k := range r.Ops {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(w, "  %-12s %d\n", k, r.Ops[k])
	}
	for k, n := range r.AsyncLosses {
		fmt.Fprintf(w, "  async loss (allowed) %s: %d\n", k, n)
	}
	for _, v := range r.Violations {
		fmt.Fprintf(w, "VIOLATION key %s: %s\n", v.Key, v.What)
		if v.File != "" {
			fmt.Fprintf(w, "  visualization: %s\n", v.File)
		}
		for _, l := range v.History {
			fmt.Fprintf(w, "    %s\n", l)
		}
	}
}
