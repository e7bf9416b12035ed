import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  chooseProcesses,
  DEFAULT_PROCESSES,
  hardwareSummary,
  launchPrecision,
  LaunchModel,
  statusText
} from '../src/model';
import { runCellCode, toggleSessionCode } from '../src/code';

const HELLO = {
  type: 'hello',
  hardware: { accelerators: [], logical_cores: 4, cpu_model: 'AMD EPYC', ram_total: 2 ** 33 },
  preview: {
    rows: [
      ['Distributed type', 'NO'],
      ['Processes', '1'],
      ['With num_processes=N', 'MULTI_CPU on gloo, N CPU processes']
    ],
    notes: [],
    error: null
  }
};

function ev(event: string, fields: object = {}, launch = 1) {
  return { type: 'event', launch, event, ...fields };
}

function started(model: LaunchModel, n = 2, launch = 1): void {
  model.apply(ev('LaunchStarted', { num_processes: n, start_method: 'fork' }, launch), 0);
  for (let r = 0; r < n; r++) {
    model.apply(ev('RankStarted', { rank: r, pid: 100 + r }, launch), 0);
  }
}

test('not connected until the hello, then the hardware summary', () => {
  const model = new LaunchModel();
  assert.equal(statusText(model, 2), 'not connected');
  assert.equal(model.apply({ type: 'something else' }), false);
  assert.equal(model.apply(HELLO), true);
  assert.equal(statusText(model, 2), '2 x CPU · MULTI_CPU · fp32');
  assert.equal(statusText(model, 3), '3 x CPU · MULTI_CPU · fp32');
});

test('the summary names accelerators and a launch that would fail', () => {
  const gpus = {
    ...HELLO,
    hardware: { accelerators: [{ name: 'NVIDIA H200' }, { name: 'NVIDIA H200' }] },
    preview: { rows: [['Distributed type', 'MULTI_GPU'], ['Processes', '2']], notes: [], error: null }
  } as any;
  assert.equal(hardwareSummary(gpus, 4), '2 x NVIDIA H200 · MULTI_GPU · fp32');
  const broken = { ...HELLO, preview: { rows: [], notes: [], error: 'no port' } } as any;
  assert.equal(hardwareSummary(broken, 2), 'launch would fail: no port');
});

test('a launch: running, then finished', () => {
  const model = new LaunchModel();
  model.apply(HELLO);
  model.apply(ev('LaunchStarted', { num_processes: 2, start_method: 'fork' }), 0);
  model.apply(ev('RankStarted', { rank: 0, pid: 10 }), 0);
  assert.equal(statusText(model, 2), '1/2 ranks running');
  model.apply(ev('RankStarted', { rank: 1, pid: 11 }), 0);
  assert.equal(statusText(model, 2), '2/2 ranks running');
  model.apply(ev('RankFinished', { rank: 0, seconds: 1 }), 1000);
  assert.equal(statusText(model, 2), '1/2 ranks running');
  model.apply(ev('RankFinished', { rank: 1, seconds: 1 }), 1200);
  model.apply(ev('LaunchFinished', { ok: true, seconds: 1.23, failed_ranks: [], stopped: '' }), 1200);
  assert.equal(statusText(model, 2), 'finished in 1.2 s');
  assert.equal(model.current?.ranks.get(1)?.state, 'done');
  assert.equal(model.current?.ranks.get(1)?.seconds, 1.2);
});

test('a failed rank and a stopped launch', () => {
  const model = new LaunchModel();
  model.apply(HELLO);
  started(model);
  model.apply(ev('RankFailed', { rank: 1, pid: 101, exitcode: 1, summary: 'rank 1 raised ValueError: x' }), 500);
  assert.equal(statusText(model, 2), 'rank 1 failed');
  assert.equal(model.current?.ranks.get(1)?.detail, 'rank 1 raised ValueError: x');

  started(model, 2, 2);
  assert.equal(model.launches.length, 2);
  assert.equal(statusText(model, 2), '2/2 ranks running'); // the newest launch counts
  model.apply(ev('LaunchFinished', { ok: false, seconds: 3, failed_ranks: [], stopped: 'stopped from X' }, 2), 3000);
  assert.equal(statusText(model, 2), 'stopped after 3.0 s');
  assert.equal(model.current?.ranks.get(0)?.state, 'stopped'); // no rank is left "running"
});

test('output lines: batched, capped, progress bars replace themselves', () => {
  const model = new LaunchModel();
  started(model, 1);
  model.apply(ev('RankOutput', { rank: 0, lines: [['stdout', 'a', false], ['stderr', '10%', true]], dropped: 3 }));
  model.apply(ev('RankOutput', { rank: 0, lines: [['stderr', '50%', true]], dropped: 0 }));
  const r = model.current!.ranks.get(0)!;
  assert.deepEqual(r.lines.map(l => l.text), ['a', '50%']);
  assert.equal(r.dropped, 3);
  const many = Array.from({ length: 60 }, (_, i) => ['stdout', `line ${i}`, false]);
  model.apply(ev('RankOutput', { rank: 0, lines: many, dropped: 0 }));
  assert.equal(r.lines.length, 50);
  assert.equal(r.lines[49].text, 'line 59');
  assert.equal(r.dropped, 3 + 12);
});

test('events of a launch whose start was missed, and only five launches kept', () => {
  const model = new LaunchModel();
  model.apply(ev('RankOutput', { rank: 1, lines: [['stdout', 'x', false]], dropped: 0 }, 7));
  assert.equal(model.current?.id, 7);
  assert.equal(model.current?.ranks.get(1)?.state, 'running');
  for (let id = 8; id < 20; id++) {
    started(model, 1, id);
  }
  assert.equal(model.launches.length, 5);
  assert.equal(model.current?.id, 19);
  model.reset();
  assert.equal(model.launches.length, 0);
  assert.equal(model.connected, false);
});

test('the code the commands send', () => {
  const code = runCellCode('print("rank", 1)\nx = \'\\n\'', 3);
  assert.match(code, /^get_ipython\(\)\.run_cell_magic\('accelerate', '' if .* else "-n 3 --port auto", /);
  assert.ok(code.endsWith(`${JSON.stringify('print("rank", 1)\nx = \'\\n\'')})`));
  assert.match(toggleSessionCode(4), /'stop' if .* else 'start -n 4'\)$/);
});

// A getter read through a function: assert.equal(x, undefined) would narrow x to never.
const live = (model: LaunchModel) => model.session;

function session(id: number, state: string, pids: number[], rankState = 'idle') {
  return {
    type: 'session',
    id,
    state,
    workers: pids.length,
    start_method: 'fork',
    ranks: pids.map((pid, rank) => ({ rank, pid, state: rankState, device: 'cpu' }))
  };
}

test('sessions: started, restarted (new pids), stopped; the status bar says so', () => {
  const model = new LaunchModel();
  model.apply(HELLO);
  assert.equal(live(model), undefined);
  assert.equal(model.apply(session(1, 'running', [20, 21]), 0), true);
  assert.equal(live(model)?.workers, 2);
  assert.deepEqual(live(model)?.ranks.map(r => r.pid), [20, 21]);
  assert.equal(statusText(model, 2), '2 x CPU · MULTI_CPU · fp32 · session: 2 workers');
  model.apply(session(1, 'restarting', [20, 21], 'busy'));
  assert.equal(statusText(model, 2), '2 x CPU · MULTI_CPU · fp32 · session: restarting');
  model.apply(session(1, 'running', [30, 31]));
  assert.equal(live(model)?.restarts, 1);
  assert.deepEqual(live(model)?.ranks.map(r => r.pid), [30, 31]);
  // While a session cell runs, the launch's text alone; after it, the session again.
  started(model);
  assert.equal(statusText(model, 2), '2/2 ranks running');
  model.apply(ev('LaunchFinished', { ok: true, seconds: 1, failed_ranks: [], stopped: '' }), 1000);
  assert.equal(statusText(model, 2), 'finished in 1.0 s · session: 2 workers');
  model.apply(session(1, 'stopped', [30, 31], 'stopped'));
  assert.equal(live(model), undefined);
  assert.equal(model.sessions.length, 1); // kept as a recent one
  assert.equal(statusText(model, 2), 'finished in 1.0 s');
});

test('sessions: a hello names the live one; older ones are marked stopped; three kept', () => {
  const model = new LaunchModel();
  model.apply({ ...HELLO, session: session(2, 'running', [40, 41]) });
  assert.equal(live(model)?.id, 2);
  model.apply(session(1, 'running', [10])); // a late message about an older session
  assert.equal(live(model)?.id, 2); // newest first, by id
  model.apply({ ...HELLO, session: null });
  assert.equal(live(model), undefined);
  assert.ok(model.sessions.every(s => s.state === 'stopped' && s.ranks.every(r => r.state === 'stopped')));
  for (let id = 3; id < 8; id++) {
    model.apply(session(id, 'running', [id]));
  }
  assert.deepEqual(model.sessions.map(s => s.id), [7, 6, 5]);
  model.reset();
  assert.equal(model.sessions.length, 0);
});

test('notices are queued once for the page to show', () => {
  const model = new LaunchModel();
  assert.equal(model.apply({ type: 'notice', level: 'warning', text: 'busy' }), true);
  model.apply({ type: 'notice', level: 'bogus', text: 'x' });
  assert.deepEqual(model.takeNotices(), [
    { level: 'warning', text: 'busy' },
    { level: 'info', text: 'x' }
  ]);
  assert.deepEqual(model.takeNotices(), []);
});

test('a multi-node notice shows until a rank starts', () => {
  const model = new LaunchModel();
  model.apply(HELLO);
  model.apply(ev('LaunchStarted', { num_processes: 2, start_method: 'forkserver' }), 0);
  assert.equal(statusText(model, 2), '0/2 ranks running');
  model.apply(ev('LaunchNotice', { text: 'node 0 of 2: waiting for the other nodes at 10.0.0.1:29500' }), 0);
  assert.equal(statusText(model, 2), 'waiting for the other nodes');
  assert.match(model.current!.notice ?? '', /at 10\.0\.0\.1:29500/);
  model.apply(ev('RankStarted', { rank: 0, pid: 10 }), 0);
  assert.equal(model.current!.notice, undefined);
  assert.equal(statusText(model, 2), '1/2 ranks running');
});

const config = (num_processes: number | null, mixed_precision: string | null = null) => ({
  file: num_processes === null && mixed_precision === null ? null : '/home/me/accel.yaml',
  num_processes,
  mixed_precision
});

test('N: the setting when given, else the config file\'s num_processes, else 2', () => {
  const withConfig = { ...HELLO, config: config(3) } as any;
  const without = { ...HELLO, config: config(null) } as any;
  // The schema's default (0): the config's, known once the kernel said hello.
  assert.deepEqual(chooseProcesses(0, withConfig), { n: 3, from: 'config' });
  assert.deepEqual(chooseProcesses(0, without), { n: DEFAULT_PROCESSES, from: 'default' });
  assert.deepEqual(chooseProcesses(0, null), { n: 2, from: 'default' }); // not connected yet
  assert.deepEqual(chooseProcesses(0, HELLO as any), { n: 2, from: 'default' }); // an older kernel: no config
  // An explicit value wins over the config.
  assert.deepEqual(chooseProcesses(4, withConfig), { n: 4, from: 'setting' });
  assert.deepEqual(chooseProcesses(1, withConfig), { n: 1, from: 'setting' });
  // Nothing usable from either: the default.
  assert.deepEqual(chooseProcesses(undefined, { ...HELLO, config: config(0) } as any), { n: 2, from: 'default' });
  assert.deepEqual(chooseProcesses(null, { ...HELLO, config: config(2.5) } as any), { n: 2, from: 'default' });
  assert.deepEqual(chooseProcesses(-1, withConfig), { n: 3, from: 'config' });
});

test('the summary ends with the precision a launch would use: the config\'s, else fp32', () => {
  const model = new LaunchModel();
  model.apply({ ...HELLO, config: config(3, 'bf16') });
  assert.equal(launchPrecision(model.hello!), 'bf16');
  assert.equal(statusText(model, 3), '3 x CPU · MULTI_CPU · bf16');
  assert.equal(launchPrecision({ ...HELLO, config: config(3, 'no') } as any), 'fp32'); // "no": full precision
  assert.equal(launchPrecision({ ...HELLO, config: config(null) } as any), 'fp32');
  assert.equal(launchPrecision({ ...HELLO, config: config(null, 'fp8') } as any), 'fp8');
  // A kernel that sends no config: its launch preview's row says the same.
  const older = { ...HELLO, preview: { rows: [['Mixed precision', 'fp16']], notes: [], error: null } } as any;
  assert.equal(launchPrecision(older), 'fp16');
  // The example.
  const gpus = {
    type: 'hello',
    hardware: { accelerators: Array.from({ length: 8 }, () => ({ name: 'H100' })) },
    preview: { rows: [['Distributed type', 'MULTI_GPU'], ['Processes', '8']], notes: [], error: null },
    config: config(null, 'bf16')
  } as any;
  assert.equal(hardwareSummary(gpus, 2), '8 x H100 · MULTI_GPU · bf16');
});

const STALL = {
  sentence: 'stalled for 2 s: rank 0 waits in all_reduce #1 (float32[4]); rank 1 waits in barrier #1',
  stalled: true,
  seconds: 2.1,
  ranks: [
    { rank: 0, state: 'waiting', doing: 'waits in all_reduce #1 (float32[4]) at Cell In[2], line 6, in f' },
    { rank: 1, state: 'waiting', doing: 'waits in barrier #1 at Cell In[2], line 8, in f' }
  ],
  text: 'stalled for 2 s: ...\n\nrank 0: waits in all_reduce #1'
};

test('a stall: kept until LaunchResumed; its text, sent only when it changed, is remembered', () => {
  const model = new LaunchModel();
  model.apply(ev('LaunchStarted', { num_processes: 2, start_method: 'fork' }), 0);
  model.apply(ev('LaunchStalled', { stall: STALL }), 10);
  const stall = () => model.current!.stall; // read again: assert.equal narrows what it checked
  assert.equal(stall()?.sentence, STALL.sentence);
  assert.equal(stall()?.stalled, true);
  assert.deepEqual(stall()?.ranks.map(r => r.rank), [0, 1]);
  assert.equal(stall()?.text, STALL.text);
  model.apply(ev('LaunchResumed', { stall: null }), 20);
  assert.equal(stall(), undefined);
  const { text, ...again } = STALL; // the same report again: the kernel leaves its text out
  model.apply(ev('LaunchStalled', { stall: { ...again, stalled: false } }), 30);
  assert.equal(stall()?.text, text);
  assert.equal(stall()?.stalled, false);
  model.apply(ev('LaunchStalled', { stall: null }), 40); // nothing usable: no stall
  assert.equal(stall(), undefined);
  model.apply(ev('LaunchStalled', { stall: STALL }), 50);
  model.apply(ev('LaunchFinished', { ok: false, seconds: 8, stopped: 'timed out', failed_ranks: [] }), 60);
  assert.equal(stall()?.sentence, STALL.sentence); // a stall that ended the launch stays: it says why
});
