package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
)

// Op is one attempted operation: its invocation (T0) and completion (T1) times in Unix
// nanoseconds, and how it ended. Res is "ok" (it ran and Out is its result), "fail" (it did not
// run: a refusal before execution, or a connection that could not be opened) or "info" (unknown:
// a timeout, a broken connection, or a write refused after it was applied in memory).
type Op struct {
	P   int    `json:"p"`
	F   string `json:"f"`
	K   string `json:"k"`
	V   string `json:"v,omitempty"`
	Res string `json:"res"`
	Out string `json:"out,omitempty"`
	Nil bool   `json:"nil,omitempty"`
	Err string `json:"err,omitempty"`
	T0  int64  `json:"t0"`
	T1  int64  `json:"t1"`
}

func (o Op) String() string {
	s := fmt.Sprintf("p%-4d %-4s %s", o.P, o.F, o.K)
	if o.V != "" {
		s += " " + o.V
	}
	switch {
	case o.Res == "ok" && o.Nil:
		s += " -> nil"
	case o.Res == "ok":
		s += " -> " + o.Out
	default:
		s += " -> " + o.Res
		if o.Err != "" {
			s += " (" + o.Err + ")"
		}
	}
	return s
}

// isWrite tells the operations that change state.
func isWrite(f string) bool { return f == "set" || f == "del" || f == "incr" }

// keyKind is 'r' (register), 'c' (counter), 's' (written once, maybe deleted), 'b' (a register
// of the bulk client) or 'e' (a register whose key or value is an edge case: see realKey).
func keyKind(k string) byte { return k[0] }

func readHistory(path string) ([]Op, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var ops []Op
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	line := 0
	for sc.Scan() {
		line++
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		var o Op
		if err := json.Unmarshal(sc.Bytes(), &o); err != nil {
			return nil, fmt.Errorf("%s line %d: %v", path, line, err)
		}
		if o.K == "" || (o.Res != "ok" && o.Res != "fail" && o.Res != "info") {
			return nil, fmt.Errorf("%s line %d: not an operation", path, line)
		}
		ops = append(ops, o)
	}
	return ops, sc.Err()
}

func appendHistory(path string, ops []Op) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	enc := json.NewEncoder(w)
	for _, o := range ops {
		if err := enc.Encode(o); err != nil {
			f.Close()
			return err
		}
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// byKey groups the operations by key, each group by invocation time.
func byKey(ops []Op) map[string][]Op {
	m := map[string][]Op{}
	for _, o := range ops {
		m[o.K] = append(m[o.K], o)
	}
	for _, g := range m {
		sort.SliceStable(g, func(i, j int) bool { return g[i].T0 < g[j].T0 })
	}
	return m
}
