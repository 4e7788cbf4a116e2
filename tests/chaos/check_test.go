package main

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// h builds a history from compact rows: process, op, key, value/out, result, start, end.
func op(p int, f, k, v, res, out string, t0, t1 int64) Op {
	o := Op{P: p, F: f, K: k, V: v, Res: res, Out: out, T0: t0, T1: t1}
	if f == "get" && res == "ok" && out == "" {
		o.Nil = true
	}
	return o
}

func check(t *testing.T, mode string, ops []Op) Result {
	t.Helper()
	return Check(mode, ops, 5*time.Second, "")
}

func TestLinearizableHistoryPasses(t *testing.T) {
	ops := []Op{
		op(0, "set", "r0:1", "a", "ok", "OK", 0, 10),
		op(1, "get", "r0:1", "", "ok", "a", 5, 15), // concurrent with the write: may see it
		op(0, "set", "r0:1", "b", "ok", "OK", 20, 30),
		op(1, "get", "r0:1", "", "ok", "b", 31, 40),
		op(2, "incr", "c0:0", "", "ok", "1", 0, 5),
		op(3, "incr", "c0:0", "", "info", "", 6, 7), // unknown: may count or not
		op(2, "get", "c0:0", "", "ok", "1", 50, 60),
		op(2, "set", "s2:1", "v2.1", "ok", "OK", 0, 5),
		op(2, "get", "s2:1", "", "ok", "v2.1", 100, 101),
	}
	r := check(t, "sync", ops)
	if len(r.Violations) != 0 || r.Linearized != 3 {
		t.Fatalf("expected no violation: %+v", r)
	}
}

func TestStaleReadIsCaught(t *testing.T) {
	ops := []Op{
		op(0, "set", "r0:1", "a", "ok", "OK", 0, 10),
		op(0, "set", "r0:1", "b", "ok", "OK", 20, 30),
		op(1, "get", "r0:1", "", "ok", "a", 40, 50), // b was acknowledged before this read began
	}
	r := check(t, "durable", ops)
	if len(r.Violations) != 1 || r.Violations[0].What != "not linearizable" {
		t.Fatalf("stale read not caught: %+v", r)
	}
	if !strings.Contains(strings.Join(r.Violations[0].History, "\n"), "get  r0:1 -> a") {
		t.Fatalf("the report does not show the read: %v", r.Violations[0].History)
	}
}

func TestLostAcknowledgedWriteIsCaught(t *testing.T) {
	ops := []Op{
		op(2, "set", "s2:1", "v2.1", "ok", "OK", 0, 5),
		op(9, "get", "s2:1", "", "ok", "", 100, 101),
	}
	r := check(t, "sync", ops)
	if !hasViolation(r, "s2:1", "acknowledged write is missing") {
		t.Fatalf("lost write not caught: %+v", r)
	}
	// The same with an unknown write is allowed.
	ops[0].Res = "info"
	if r := check(t, "sync", ops); len(r.Violations) != 0 {
		t.Fatalf("an unknown write need not survive: %+v", r)
	}
}

func TestDeletedKeyBackIsCaught(t *testing.T) {
	ops := []Op{
		op(2, "set", "s2:1", "v2.1", "ok", "OK", 0, 5),
		op(2, "del", "s2:1", "", "ok", "1", 10, 15),
		op(9, "get", "s2:1", "", "ok", "v2.1", 100, 101),
	}
	r := check(t, "mirror", ops)
	if !hasViolation(r, "s2:1", "deleted key came back") {
		t.Fatalf("resurrection not caught: %+v", r)
	}
}

func TestCounterLostOrDoubledIsCaught(t *testing.T) {
	base := []Op{
		op(0, "incr", "c0:0", "", "ok", "1", 0, 5),
		op(1, "incr", "c0:0", "", "ok", "2", 10, 15),
	}
	doubled := append(append([]Op{}, base...), op(9, "get", "c0:0", "", "ok", "3", 100, 101))
	if r := check(t, "sync", doubled); !hasViolation(r, "c0:0", "doubled") {
		t.Fatalf("doubled increment not caught: %+v", r)
	}
	lost := append(append([]Op{}, base...), op(9, "get", "c0:0", "", "ok", "1", 100, 101))
	if r := check(t, "sync", lost); !hasViolation(r, "c0:0", "lost increments") {
		t.Fatalf("lost increment not caught: %+v", r)
	}
	// Async may lose an increment, never double one.
	if r := check(t, "async", lost); len(r.Violations) != 0 || r.AsyncLosses["counter_increments_lost"] != 1 {
		t.Fatalf("async: %+v", r)
	}
	if r := check(t, "async", doubled); !hasViolation(r, "c0:0", "") {
		t.Fatalf("async doubled not caught: %+v", r)
	}
}

func TestAsyncInventedValueIsCaught(t *testing.T) {
	ops := []Op{
		op(0, "set", "r0:1", "a", "ok", "OK", 0, 10),
		op(1, "get", "r0:1", "", "ok", "zzz", 20, 30),
		op(1, "get", "r0:1", "", "ok", "b", 40, 50), // read before b's write was invoked
		op(0, "set", "r0:1", "b", "ok", "OK", 60, 70),
	}
	r := check(t, "async", ops)
	if len(r.Violations) != 2 {
		t.Fatalf("expected two violations: %+v", r)
	}
}

func TestFailedWriteMustNotTakeEffect(t *testing.T) {
	// A write refused before it ran (MOVED, TRYAGAIN, CLUSTERDOWN) must not be read.
	ops := []Op{
		op(0, "set", "r0:1", "a", "ok", "OK", 0, 10),
		op(0, "set", "r0:1", "b", "fail", "", 20, 30),
		op(1, "get", "r0:1", "", "ok", "b", 40, 50),
	}
	if r := check(t, "sync", ops); len(r.Violations) != 1 {
		t.Fatalf("a failed write's value read back was not caught: %+v", r)
	}
}

func TestUnknownWriteMayAppearLate(t *testing.T) {
	ops := []Op{
		op(0, "set", "r0:1", "a", "ok", "OK", 0, 10),
		op(1, "set", "r0:1", "b", "info", "", 20, 30),
		op(2, "get", "r0:1", "", "ok", "a", 40, 50),
		op(2, "get", "r0:1", "", "ok", "b", 60, 70),
		op(2, "get", "r0:1", "", "ok", "b", 80, 90),
	}
	if r := check(t, "sync", ops); len(r.Violations) != 0 {
		t.Fatalf("%+v", r)
	}
	// ... but not disappear again once read.
	ops = append(ops, op(2, "get", "r0:1", "", "ok", "a", 100, 110))
	if r := check(t, "sync", ops); len(r.Violations) != 1 {
		t.Fatalf("%+v", r)
	}
}

func TestRespReaderRejectsBadInput(t *testing.T) {
	for _, in := range []string{"$5\r\nab\r\n", "*2\r\n:1\r\n", "?x\r\n", "$-2\r\n", ":x\r\n", "+ok\n"} {
		if _, err := readReply(bufioReader(in), 0); err == nil {
			t.Fatalf("accepted %q", in)
		}
	}
	r, err := readReply(bufioReader("*2\r\n$1\r\na\r\n$-1\r\n"), 0)
	if err != nil || len(r.Elems) != 2 || r.Elems[0].Str != "a" || !r.Elems[1].Nil {
		t.Fatalf("%+v %v", r, err)
	}
}

func TestKeySlotMatchesRedis(t *testing.T) {
	// Values from Redis Cluster's specification and `CLUSTER KEYSLOT`.
	if keySlot("123456789") != 12739 || keySlot("foo") != 12182 || keySlot("{user1000}.following") != keySlot("user1000") {
		t.Fatal("slot mismatch")
	}
}

func hasViolation(r Result, key, what string) bool {
	for _, v := range r.Violations {
		if v.Key == key && strings.Contains(v.What, what) {
			return true
		}
	}
	return false
}

func bufioReader(s string) *bufio.Reader { return bufio.NewReader(strings.NewReader(s)) }

// FuzzReadReply: the reply reader never panics and never accepts a reply it did not consume whole.
func FuzzReadReply(f *testing.F) {
	for _, s := range []string{"+OK\r\n", "-MOVED 1 a:1\r\n", ":12\r\n", "$3\r\nabc\r\n", "$-1\r\n", "*2\r\n$1\r\na\r\n:1\r\n", "*-1\r\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r := bufioReader(s)
		if _, err := readReply(r, 0); err == nil && r.Buffered() > len(s) {
			t.Fatal("read past the input")
		}
	})
}

// FuzzHistoryLine: the history reader rejects what is not an operation and keeps what is.
func FuzzHistoryLine(f *testing.F) {
	f.Add(`{"p":1,"f":"set","k":"r0:1","v":"a","res":"ok","out":"OK","t0":1,"t1":2}`)
	f.Add(`{"k":""}`)
	f.Fuzz(func(t *testing.T, line string) {
		path := filepath.Join(t.TempDir(), "h.jsonl")
		if err := os.WriteFile(path, []byte(line+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		ops, err := readHistory(path)
		if err == nil {
			for _, o := range ops {
				if o.K == "" || (o.Res != "ok" && o.Res != "fail" && o.Res != "info") {
					t.Fatalf("accepted %+v", o)
				}
			}
		}
	})
}

func TestEdgeAliasesRoundTrip(t *testing.T) {
	if realKey(emptyKey) != "" {
		t.Fatal("the alias e is the empty key")
	}
	if k := realKey("e3:m"); len(k) != keyMaxBytes {
		t.Fatalf("the longest key has %d bytes", len(k))
	}
	if k := realKey("e3:b"); !strings.Contains(k, "\x00") || !strings.Contains(k, everyByte) {
		t.Fatal("a binary key holds NUL and every byte value")
	}
	if realKey("r1:2") != "r1:2" {
		t.Fatal("other keys stand for themselves")
	}
	for _, v := range []string{"", "v1.2", "X4.5"} {
		if got := aliasOf(realValue(v)); got != v {
			t.Fatalf("aliasOf(realValue(%q)) = %q", v, got)
		}
	}
	if got := aliasOf("X4.5\x00garbage"); !strings.HasPrefix(got, "corrupt:") {
		t.Fatalf("a damaged binary value is reported, not %q", got)
	}
	o := Op{F: "get", K: "e2:b", Res: "ok", Out: realValue("X1.1")}
	shrink(o.K, &o)
	if o.Out != "X1.1" {
		t.Fatalf("shrink gives %q", o.Out)
	}
}
