// A BullMQ queue and worker, unmodified, against the server at PORT (argv[2]): 1,000 jobs, of
// which every 10th fails once and succeeds on its retry, and every 100th fails for good. Prints
// a JSON summary; exits 1 if the jobs do not all finish within the time limit.
const { Queue, Worker, QueueEvents } = require('bullmq');

const port = Number(process.argv[2]);
const total = Number(process.argv[3] || 1000);
// On a cluster every key of one queue must share a slot: BullMQ's documented hash-tag prefix.
const prefix = process.argv[4] || 'bull';
const connection = { host: '127.0.0.1', port, maxRetriesPerRequest: null };

async function main() {
  const name = `jobs-${Date.now()}`;
  const queue = new Queue(name, { connection, prefix });
  const events = new QueueEvents(name, { connection, prefix });
  await events.waitUntilReady();
  const attemptsSeen = new Map();
  const worker = new Worker(
    name,
    async (job) => {
      const n = job.data.n;
      attemptsSeen.set(n, (attemptsSeen.get(n) || 0) + 1);
      if (n % 100 === 0) throw new Error(`job ${n} fails for good`);
      if (n % 10 === 0 && job.attemptsMade === 0) throw new Error(`job ${n} fails once`);
      return { sum: n + 1 };
    },
    { connection, prefix, concurrency: 8 },
  );
  let completed = 0;
  let failed = 0;
  const done = new Promise((resolve) => {
    const check = () => completed + failed === total && resolve();
    worker.on('completed', () => { completed += 1; check(); });
    worker.on('failed', (job) => {
      if (job.attemptsMade >= job.opts.attempts) { failed += 1; check(); }
    });
  });
  const jobs = [];
  for (let n = 1; n <= total; n++) {
    jobs.push({ name: 'add', data: { n }, opts: { attempts: 2, backoff: { type: 'fixed', delay: 10 } } });
  }
  for (let i = 0; i < jobs.length; i += 100) await queue.addBulk(jobs.slice(i, i + 100));
  const timer = setTimeout(() => {
    console.log(JSON.stringify({ error: 'timed out', completed, failed }));
    process.exit(1);
  }, 120000);
  await done;
  clearTimeout(timer);
  const counts = await queue.getJobCounts('completed', 'failed', 'waiting', 'active', 'delayed');
  const sample = await queue.getJob('10');
  const result = {
    completed,
    failed,
    counts,
    retried: [...attemptsSeen.values()].filter((a) => a > 1).length,
    sample: sample && { returnvalue: sample.returnvalue, attemptsMade: sample.attemptsMade },
  };
  await worker.close();
  await events.close();
  await queue.obliterate({ force: true });
  await queue.close();
  console.log(JSON.stringify(result));
}

main().catch((e) => {
  console.log(JSON.stringify({ error: String(e && e.stack || e) }));
  process.exit(1);
});
