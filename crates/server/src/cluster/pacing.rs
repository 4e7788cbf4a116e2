//! Pacing of re-protection copies by the foreground's latency.
//!
//! A copy (a tablet sent in bulk to a new backup after a recovery) competes with the clients of
//! the server that sends it for cores, memory bandwidth and the network. It is paced the way
//! TCP paces a flow (additive increase, multiplicative decrease), with the clients' latency as
//! the congestion signal: every [`WINDOW`], the p99 of the commands this server ran in that
//! window is compared with a target; above it the copy's rate halves, otherwise it grows by an
//! eighth of its ceiling. The target is twice the p99 the server had before the copy began (its
//! whole history, so what clients normally see), and at least [`TARGET_MIN_US`]. A window with
//! fewer than [`SAMPLES_MIN`] commands has no foreground to protect: the rate grows. The rate
//! stays between a floor (so that re-protection always ends: a backup short is a copy short of
//! the promised durability) and the ceiling `recovery_copy_bytes_per_sec`.

use crate::node::metrics::HistogramSnapshot;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How often the rate is adjusted.
pub const WINDOW: Duration = Duration::from_millis(100);
/// The least foreground p99 the copy is held to, µs: below it, latency is not the copy's doing
/// worth slowing for (one scheduling quantum on a shared core is a few ms).
pub const TARGET_MIN_US: u64 = 2_000;
/// Commands a window needs before its p99 means anything.
pub const SAMPLES_MIN: u64 = 20;
/// The floor is the ceiling divided by this, and at least [`FLOOR_MIN_BYTES_PER_SEC`].
const FLOOR_DIVISOR: u64 = 16;
const FLOOR_MIN_BYTES_PER_SEC: u64 = 4 << 20;

/// How far back [`AckBaseline`] looks for the foreground's uncongested acknowledgement wait.
pub const BASELINE_SPAN: Duration = Duration::from_secs(60);
/// Windows [`AckBaseline`] keeps at most (the oldest go first).
const BASELINE_WINDOWS_MAX: usize = 1024;
/// The least mean acknowledgement wait a copy is held to, µs: below it, a wait is within what
/// a loopback round trip and a wake-up cost on a shared core anyway.
pub const ACK_TARGET_MIN_US: u64 = 200;

/// The wait of this server's replicated writes for their backups' acknowledgements when no copy
/// loads the machine: the lowest mean of the recent windows in which this server ran no copy
/// (as TCP BBR takes the lowest round trip it saw as the path's own). The commands' own run time
/// hardly moves while a copy runs; what a copy costs the clients of a `sync` or `durable` table
/// shows in this wait (the backups that take the copy, the cores both share), so the copy is
/// held to twice it ([`Pacer::begin`]). Sampled with every heartbeat.
#[derive(Default)]
pub struct AckBaseline {
    last: Option<HistogramSnapshot>,
    /// (end of the window, mean wait in ns), oldest first.
    windows: VecDeque<(Instant, u64)>,
}

impl AckBaseline {
    /// A new reading of the cumulative acknowledgement-wait histogram; `copying` says whether a
    /// copy of this server ran during the window that ends now (such windows do not count).
    pub fn sample(&mut self, now: Instant, reading: HistogramSnapshot, copying: bool) {
        if let Some(last) = self.last.take() {
            let w = window(&reading, &last);
            if !copying && w.count >= SAMPLES_MIN {
                self.windows.push_back((now, w.sum_ns / w.count));
            }
        }
        self.last = Some(reading);
        while self.windows.len() > BASELINE_WINDOWS_MAX
            || self
                .windows
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) > BASELINE_SPAN)
        {
            self.windows.pop_front();
        }
    }

    /// The lowest mean wait of the windows kept, ns; None without one.
    pub fn baseline_ns(&self) -> Option<u64> {
        self.windows.iter().map(|w| w.1).min()
    }
}

/// What one window did to the rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The foreground was over its target: the rate halved.
    Slowed,
    /// The foreground was within its target (or idle): the rate grew.
    Grew,
}

/// The rate after a window: halved when the window's p99 (`p99_us` over `samples` commands) is
/// above `target_us`, otherwise grown by an eighth of `ceiling`; kept within `floor..=ceiling`.
pub fn adjust(
    rate: u64,
    floor: u64,
    ceiling: u64,
    p99_us: u64,
    samples: u64,
    target_us: u64,
) -> (u64, Step) {
    if samples >= SAMPLES_MIN && p99_us > target_us {
        ((rate / 2).clamp(floor, ceiling), Step::Slowed)
    } else {
        (
            rate.saturating_add((ceiling / 8).max(1))
                .clamp(floor, ceiling),
            Step::Grew,
        )
    }
}

/// The counts of `now` minus those of `before` (two readings of one cumulative histogram).
pub fn window(now: &HistogramSnapshot, before: &HistogramSnapshot) -> HistogramSnapshot {
    HistogramSnapshot {
        buckets: now
            .buckets
            .iter()
            .zip(before.buckets.iter().chain(std::iter::repeat(&0)))
            .map(|(n, b)| n.saturating_sub(*b))
            .collect(),
        count: now.count.saturating_sub(before.count),
        sum_ns: now.sum_ns.saturating_sub(before.sum_ns),
    }
}

/// Paces a server's copies (they run one at a time): call [`Pacer::begin`] when a copy starts
/// and [`Pacer::sent`] after each frame; it sleeps as long as the current rate asks and adjusts
/// the rate once per window. The rate carries over from one copy to the next, so a series of
/// small tablets runs at the pace the foreground allows, not at a new start's each time.
pub struct Pacer {
    ceiling: u64,
    floor: u64,
    rate: u64,
    target_us: u64,
    /// The mean acknowledgement wait the copy is held to, µs (0: none known, not held).
    ack_target_us: u64,
    window_started: Instant,
    window_from: HistogramSnapshot,
    ack_from: HistogramSnapshot,
    /// When the bytes sent so far are paid for at the rates that applied.
    due: Instant,
    slowed: u64,
}

impl Default for Pacer {
    fn default() -> Self {
        let now = Instant::now();
        Pacer {
            ceiling: 0,
            floor: 0,
            rate: 0,
            target_us: TARGET_MIN_US,
            ack_target_us: 0,
            window_started: now,
            window_from: HistogramSnapshot::empty(),
            ack_from: HistogramSnapshot::empty(),
            due: now,
            slowed: 0,
        }
    }
}

impl Pacer {
    /// A copy starts, at most `ceiling` bytes per second (0: no ceiling, no pacing); `readings`
    /// are the foreground's cumulative histograms now: the commands' run time and the writes'
    /// wait for acknowledgements; `ack_baseline_ns` is that wait without a copy
    /// ([`AckBaseline`]). The first copy starts at a quarter of the ceiling (the first windows
    /// find out what the foreground tolerates); later ones where the last one ended.
    pub fn begin(
        &mut self,
        readings: (HistogramSnapshot, HistogramSnapshot),
        ack_baseline_ns: Option<u64>,
        ceiling: u64,
    ) {
        let (history, acks) = readings;
        self.target_us = history
            .quantile_us(0.99)
            .saturating_mul(2)
            .max(TARGET_MIN_US);
        self.ack_target_us = ack_baseline_ns.map_or(0, |ns| (ns / 1000 * 2).max(ACK_TARGET_MIN_US));
        self.ack_from = acks;
        self.floor = (ceiling / FLOOR_DIVISOR)
            .max(FLOOR_MIN_BYTES_PER_SEC)
            .min(ceiling);
        let start = if self.rate == 0 || self.ceiling != ceiling {
            ceiling / 4
        } else {
            self.rate
        };
        self.ceiling = ceiling;
        self.rate = start.clamp(self.floor, ceiling);
        let now = Instant::now();
        self.window_started = now;
        self.window_from = history;
        self.due = now;
        self.slowed = 0;
    }

    /// The rate now, bytes per second (0: unpaced).
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The foreground p99 the copy is held to, µs.
    pub fn target_us(&self) -> u64 {
        self.target_us
    }

    /// The mean acknowledgement wait the copy is held to, µs (0: none).
    pub fn ack_target_us(&self) -> u64 {
        self.ack_target_us
    }

    /// Windows of the current copy in which it slowed down for the foreground.
    pub fn slowed(&self) -> u64 {
        self.slowed
    }

    /// `bytes` more were sent: waits until they are paid for at the current rate, adjusting the
    /// rate at each window's end from the foreground's cumulative histograms (`readings`: the
    /// commands' run time and the writes' acknowledgement wait). A window whose mean wait is
    /// over its target slows the copy as one whose p99 run time is over its own.
    pub fn sent(
        &mut self,
        bytes: u64,
        readings: impl Fn() -> (HistogramSnapshot, HistogramSnapshot),
    ) {
        if self.ceiling == 0 {
            return;
        }
        let now = Instant::now();
        // Time not used (the copy was slower than its rate) is not saved up for a burst.
        self.due = self.due.max(now) + Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        if now.duration_since(self.window_started) >= WINDOW {
            let (reading, acks) = readings();
            let w = window(&reading, &self.window_from);
            let a = window(&acks, &self.ack_from);
            let acks_slow = self.ack_target_us > 0
                && a.count >= SAMPLES_MIN
                && a.sum_ns / a.count / 1000 > self.ack_target_us;
            let (rate, step) = if acks_slow {
                (
                    (self.rate / 2).clamp(self.floor, self.ceiling),
                    Step::Slowed,
                )
            } else {
                adjust(
                    self.rate,
                    self.floor,
                    self.ceiling,
                    w.quantile_us(0.99),
                    w.count,
                    self.target_us,
                )
            };
            if step == Step::Slowed {
                self.slowed += 1;
            }
            self.rate = rate;
            self.window_from = reading;
            self.ack_from = acks;
            self.window_started = now;
        }
        if let Some(wait) = self.due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::metrics::Histogram;
    use std::sync::Arc;

    #[test]
    fn the_rate_halves_above_the_target_and_grows_within_it() {
        let (floor, ceiling) = (8, 128);
        // Over the target with enough samples: halves, not below the floor.
        assert_eq!(
            adjust(128, floor, ceiling, 4096, 100, 2000),
            (64, Step::Slowed)
        );
        assert_eq!(
            adjust(12, floor, ceiling, 4096, 100, 2000),
            (8, Step::Slowed)
        );
        // Within it: grows by an eighth of the ceiling, not above it.
        assert_eq!(
            adjust(64, floor, ceiling, 1024, 100, 2000),
            (80, Step::Grew)
        );
        assert_eq!(
            adjust(120, floor, ceiling, 1024, 100, 2000),
            (128, Step::Grew)
        );
        // Too few commands to judge: the foreground is idle, the copy may go faster.
        assert_eq!(
            adjust(64, floor, ceiling, 1 << 20, 3, 2000),
            (80, Step::Grew)
        );
    }

    type Readings<'a> = &'a dyn Fn() -> (HistogramSnapshot, HistogramSnapshot);

    /// A copy's frame in these tests.
    const FRAME: u64 = 256 << 10;

    /// Sends frames for 800 ms, `load` recording each frame's share of the foreground: the
    /// lowest rate the pacer ran at.
    fn slowest(pacer: &mut Pacer, load: &dyn Fn(), readings: Readings<'_>) -> u64 {
        let mut lowest = u64::MAX;
        let until = Instant::now() + Duration::from_millis(800);
        while Instant::now() < until {
            load();
            pacer.sent(FRAME, readings);
            lowest = lowest.min(pacer.rate());
        }
        lowest
    }

    /// Sends frames, `load` recording the foreground, until the rate is back at `ceiling`
    /// (within 5 s).
    fn climb(pacer: &mut Pacer, ceiling: u64, load: &dyn Fn(), readings: Readings<'_>) {
        let started = Instant::now();
        while pacer.rate() < ceiling {
            load();
            pacer.sent(FRAME, readings);
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{}",
                pacer.rate()
            );
        }
    }

    #[test]
    fn a_window_counts_only_what_happened_in_it() {
        let h = Histogram::default();
        for _ in 0..1000 {
            h.record(Duration::from_micros(10));
        }
        let before = h.read();
        for _ in 0..100 {
            h.record(Duration::from_millis(9));
        }
        let w = window(&h.read(), &before);
        assert_eq!(w.count, 100);
        assert_eq!(w.quantile_us(0.99), 16384);
        assert_eq!(before.quantile_us(0.99), 16);
    }

    /// A copy paced against a foreground that turns slow, then fast again: it slows down to the
    /// floor, then climbs back to the ceiling, and the bytes it sends match the rates it ran at.
    #[test]
    fn a_pacer_backs_off_while_the_foreground_is_slow_and_recovers_after() {
        let h = Arc::new(Histogram::default());
        for _ in 0..1000 {
            h.record(Duration::from_micros(100));
        }
        let ceiling = 64 << 20;
        let mut pacer = Pacer::default();
        pacer.begin((h.read(), HistogramSnapshot::empty()), None, ceiling);
        assert_eq!(pacer.target_us(), TARGET_MIN_US);
        assert_eq!(pacer.ack_target_us(), 0);
        assert_eq!(pacer.rate(), ceiling / 4);
        let readings = || (h.read(), HistogramSnapshot::empty());
        // The foreground is slow: each window has many 10 ms commands.
        let record = |d| (0..50).for_each(|_| h.record(d));
        let lowest = slowest(&mut pacer, &|| record(Duration::from_millis(10)), &readings);
        assert_eq!(lowest, FLOOR_MIN_BYTES_PER_SEC, "slowed to the floor");
        assert!(pacer.slowed() >= 2, "{}", pacer.slowed());
        // Fast again: back to the ceiling within a second or so.
        climb(
            &mut pacer,
            ceiling,
            &|| record(Duration::from_micros(50)),
            &readings,
        );
        // Sending 8 MiB at the ceiling takes about 1/8 s.
        let t = Instant::now();
        for _ in 0..32 {
            pacer.sent(FRAME, readings);
        }
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(100) && took < Duration::from_millis(600),
            "{took:?}"
        );
        // The next copy starts where this one ended.
        pacer.begin((h.read(), HistogramSnapshot::empty()), None, ceiling);
        assert_eq!(pacer.rate(), ceiling);
    }

    #[test]
    fn no_ceiling_means_no_pacing() {
        let mut pacer = Pacer::default();
        pacer.begin(
            (HistogramSnapshot::empty(), HistogramSnapshot::empty()),
            None,
            0,
        );
        let t = Instant::now();
        pacer.sent(1 << 30, || {
            (HistogramSnapshot::empty(), HistogramSnapshot::empty())
        });
        assert!(t.elapsed() < Duration::from_millis(50));
    }

    /// The commands run as fast as before, but the writes wait for their backups twice and more
    /// as long as without the copy: the copy slows to the floor; when the wait is back near the
    /// baseline, it climbs again.
    #[test]
    fn a_pacer_backs_off_while_writes_wait_long_for_their_backups() {
        let (cmds, acks) = (
            Arc::new(Histogram::default()),
            Arc::new(Histogram::default()),
        );
        let ceiling = 64 << 20;
        let mut pacer = Pacer::default();
        // Without copies, writes waited 150 µs.
        pacer.begin((cmds.read(), acks.read()), Some(150_000), ceiling);
        assert_eq!(pacer.ack_target_us(), 300);
        let readings = || (cmds.read(), acks.read());
        let record = |ack| {
            for _ in 0..50 {
                cmds.record(Duration::from_micros(5));
                acks.record(ack);
            }
        };
        let lowest = slowest(
            &mut pacer,
            &|| record(Duration::from_micros(700)),
            &readings,
        );
        assert_eq!(lowest, FLOOR_MIN_BYTES_PER_SEC, "slowed to the floor");
        assert!(pacer.slowed() >= 2, "{}", pacer.slowed());
        climb(
            &mut pacer,
            ceiling,
            &|| record(Duration::from_micros(200)),
            &readings,
        );
        // A tiny baseline is held to the least target, not to twice itself.
        pacer.begin((cmds.read(), acks.read()), Some(20_000), ceiling);
        assert_eq!(pacer.ack_target_us(), ACK_TARGET_MIN_US);
    }

    /// The baseline is the lowest mean of the windows without a copy, recent ones only, and a
    /// window with too few writes does not count.
    #[test]
    fn the_ack_baseline_is_the_lowest_recent_window_without_a_copy() {
        let h = Histogram::default();
        let mut b = AckBaseline::default();
        let t0 = Instant::now();
        b.sample(t0, h.read(), false);
        assert_eq!(b.baseline_ns(), None);
        let mut at = t0;
        let mut window_of = |us: u64, n: usize, copying: bool, b: &mut AckBaseline| {
            for _ in 0..n {
                h.record(Duration::from_micros(us));
            }
            at += Duration::from_millis(100);
            b.sample(at, h.read(), copying);
        };
        window_of(400, 100, false, &mut b);
        assert_eq!(b.baseline_ns(), Some(400_000));
        window_of(150, 100, false, &mut b);
        window_of(300, 100, false, &mut b);
        assert_eq!(b.baseline_ns(), Some(150_000));
        // A copy's windows and near-idle windows do not count.
        window_of(50, 100, true, &mut b);
        window_of(10, 3, false, &mut b);
        assert_eq!(b.baseline_ns(), Some(150_000));
        // Past the span, old windows are forgotten.
        b.sample(at + BASELINE_SPAN + Duration::from_secs(1), h.read(), false);
        assert_eq!(b.baseline_ns(), None);
    }
}
