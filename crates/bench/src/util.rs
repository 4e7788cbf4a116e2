//! Measurement helpers shared by the suites: process RSS, medians, zipfian keys.

use rand::Rng;

/// Resident set size of this process in bytes (from /proc/self/statm).
pub fn rss_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let resident_pages: u64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    resident_pages * page.max(4096) as u64
}

/// Peak resident set size (VmHWM) of this process in bytes.
pub fn peak_rss_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("VmHWM:") {
            let kib: u64 = rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            return kib * 1024;
        }
    }
    0
}

/// Resets the peak RSS counter (writes 5 to /proc/self/clear_refs), so that phases can be measured apart.
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Median of a non-empty slice (sorts a copy).
/// CPU time (user + system) of the whole process, in seconds.
pub fn process_cpu_secs() -> f64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage for the call to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

pub fn median(values: &[f64]) -> f64 {
    assert!(!values.is_empty(), "median of nothing");
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// Zipfian generator over `0..n` (Gray et al., as in YCSB), with parameter `theta` (0.99 is YCSB's default).
pub struct Zipf {
    n: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

impl Zipf {
    pub fn new(n: u64, theta: f64) -> Self {
        assert!(n >= 2, "zipf needs at least two items");
        let zetan = zeta(n, theta);
        let zeta2 = zeta(2, theta);
        let alpha = 1.0 / (1.0 - theta);
        let eta = (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
        Zipf {
            n,
            theta,
            alpha,
            zetan,
            eta,
        }
    }

    /// A rank in `0..n`; rank 0 is the most popular. Callers scramble ranks into keys.
    pub fn sample<R: Rng>(&self, rng: &mut R) -> u64 {
        let u: f64 = rng.gen();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1;
        }
        let rank = (self.n as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        rank.min(self.n - 1)
    }
}

fn zeta(n: u64, theta: f64) -> f64 {
    (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum()
}

/// A bijective scramble of `0..2^64`, so that popular zipf ranks land on scattered keys.
pub fn scramble(rank: u64) -> u64 {
    let mut x = rank.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// How much of its time a busy thread loses to the machine: `threads` threads each spin for
/// `secs` reading the clock, and the share of wall time that passed in gaps of 100 µs or more
/// (the thread was not running) is returned, averaged over the threads. On an idle dedicated
/// machine this is near 0; on a shared or oversubscribed one it says how noisy the run was.
pub fn cpu_lost_share(threads: usize, secs: f64) -> f64 {
    let spin = move || {
        let start = std::time::Instant::now();
        let (mut last, mut lost) = (start, 0.0f64);
        loop {
            let now = std::time::Instant::now();
            let gap = now.duration_since(last).as_secs_f64();
            if gap >= 100e-6 {
                lost += gap;
            }
            last = now;
            if now.duration_since(start).as_secs_f64() >= secs {
                return lost / secs;
            }
        }
    };
    let handles: Vec<_> = (0..threads).map(|_| std::thread::spawn(spin)).collect();
    let shares: Vec<f64> = handles.into_iter().filter_map(|h| h.join().ok()).collect();
    shares.iter().sum::<f64>() / shares.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn zipf_is_skewed_and_in_range() {
        let z = Zipf::new(10_000, 0.99);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut top = 0;
        for _ in 0..100_000 {
            let r = z.sample(&mut rng);
            assert!(r < 10_000);
            if r < 100 {
                top += 1;
            }
        }
        // The top 1% of ranks draw far more than 1% of samples.
        assert!(top > 30_000, "top ranks drew {top}");
    }

    #[test]
    fn rss_is_reported() {
        assert!(rss_bytes() > 0);
    }
}
