// Command chaos-client is the workload and the checker of `scripts/chaos`:
//
//	chaos-client run   --nodes H:P,... --seed N --duration 30s --out history.jsonl
//	chaos-client final --nodes H:P,... --history history.jsonl   (reads every key once faults are over)
//	chaos-client check --mode sync --history history.jsonl --report DIR
//
// `check` exits 1 when the history breaks the mode's promise, 2 on a usage or input error.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "chaos-client: "+format+"\n", args...)
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: chaos-client run|final|check [flags]")
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	nodes := fs.String("nodes", "", "comma-separated RESP addresses of the cluster's servers")
	seed := fs.Int64("seed", 1, "seed of the operation mix")
	duration := fs.Duration("duration", 30*time.Second, "how long to drive the load")
	workers := fs.Int("workers", 8, "concurrent clients")
	timeout := fs.Duration("timeout", time.Second, "per-request timeout (then the outcome is unknown)")
	think := fs.Duration("think", 2*time.Millisecond, "pause between a client's requests")
	registers := fs.Int("registers", 16, "register keys per key period")
	counters := fs.Int("counters", 4, "counter keys per key period")
	period := fs.Duration("key-period", 5*time.Second, "how long a key is used before the next")
	bulkBytes := fs.Int("bulk-bytes", 32768, "size of the bulk client's values")
	bulkRate := fs.Int("bulk-rate", 250, "bulk writes a second (0: none)")
	bulkKeys := fs.Int("bulk-keys", 500, "keys the bulk client overwrites in turn")
	out := fs.String("out", "history.jsonl", "history file to write (run)")
	history := fs.String("history", "history.jsonl", "history file to read (final, check)")
	limit := fs.Duration("limit", 60*time.Second, "how long the final reads may take")
	mode := fs.String("mode", "sync", "the table's mode: async, sync, durable or mirror")
	report := fs.String("report", "", "directory for report.json and visualizations (check)")
	perKey := fs.Duration("per-key", 20*time.Second, "linearizability search limit per key")
	_ = fs.Parse(os.Args[2:])
	seeds := strings.Split(*nodes, ",")

	switch os.Args[1] {
	case "run":
		if *nodes == "" {
			fail("run needs --nodes")
		}
		w := Workload{Seeds: seeds, Seed: *seed, Workers: *workers, Duration: *duration, Timeout: *timeout,
			Think: *think, Registers: *registers, Counters: *counters, KeyPeriod: *period, BulkBytes: *bulkBytes, BulkRate: *bulkRate, BulkKeys: *bulkKeys}
		ops := w.Run()
		if err := os.Remove(*out); err != nil && !os.IsNotExist(err) {
			fail("%v", err)
		}
		if err := appendHistory(*out, ops); err != nil {
			fail("%v", err)
		}
		fmt.Printf("run: %d operations\n", len(ops))
	case "final":
		if *nodes == "" {
			fail("final needs --nodes")
		}
		h, err := readHistory(*history)
		if err != nil {
			fail("%v", err)
		}
		ops, unread := Final(seeds, h, *timeout, *limit)
		if err := appendHistory(*history, ops); err != nil {
			fail("%v", err)
		}
		fmt.Printf("final: %d keys read, %d unreadable\n", len(ops), len(unread))
		for i, u := range unread {
			if i == 10 {
				break
			}
			fmt.Printf("  unreadable %s\n", u)
		}
		if len(unread) > 0 {
			os.Exit(1)
		}
	case "check":
		h, err := readHistory(*history)
		if err != nil {
			fail("%v", err)
		}
		switch *mode {
		case "async", "sync", "durable", "mirror":
		default:
			fail("unknown mode %q", *mode)
		}
		if *report != "" {
			if err := os.MkdirAll(*report, 0o755); err != nil {
				fail("%v", err)
			}
		}
		r := Check(*mode, h, *perKey, *report)
		writeReport(os.Stdout, r)
		if *report != "" {
			b, _ := json.MarshalIndent(r, "", "  ")
			if err := os.WriteFile(filepath.Join(*report, "report.json"), b, 0o644); err != nil {
				fail("%v", err)
			}
		}
		if len(r.Violations) > 0 {
			os.Exit(1)
		}
	default:
		fail("unknown command %q", os.Args[1])
	}
}
