import { test } from 'node:test';
import assert from 'node:assert/strict';
import { LaunchModel } from '../src/model';
import { esc, renderPanel } from '../src/render';

test('escapes everything it shows', () => {
  assert.equal(esc('<b a="1">&'), '&lt;b a=&quot;1&quot;&gt;&amp;');
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: { cpu_model: '<script>', accelerators: [] }, preview: null });
  model.apply({ type: 'event', launch: 1, event: 'RankOutput', rank: 0, lines: [['stdout', '<img>', false]] });
  const html = renderPanel(model, 'nb.ipynb', 0);
  assert.ok(!html.includes('<script>') && !html.includes('<img>'));
  assert.ok(html.includes('&lt;img&gt;'));
});

test('not connected: says how to connect', () => {
  const html = renderPanel(new LaunchModel(), 'nb.ipynb');
  assert.match(html, /Not connected/);
  assert.match(html, /data-action="connect"/);
});

test('a running launch has a Stop button and per-rank rows; a finished one has none', () => {
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: { accelerators: [] }, preview: { rows: [['Processes', '1']], notes: [], error: null } });
  model.apply({ type: 'event', launch: 1, event: 'LaunchStarted', num_processes: 2, start_method: 'fork' }, 0);
  for (const rank of [0, 1]) {
    model.apply({ type: 'event', launch: 1, event: 'RankStarted', rank, pid: 10 + rank }, 0);
  }
  let html = renderPanel(model, 'nb.ipynb', 2500);
  assert.match(html, /data-action="stop"/);
  assert.equal((html.match(/class="nacc-x-rank"/g) ?? []).length, 2);
  assert.match(html, /2\.5 s/);
  for (const rank of [0, 1]) {
    model.apply({ type: 'event', launch: 1, event: 'RankFinished', rank, seconds: 1 }, 1000);
  }
  model.apply({ type: 'event', launch: 1, event: 'LaunchFinished', ok: true, seconds: 1, failed_ranks: [], stopped: '' });
  html = renderPanel(model, 'nb.ipynb', 5000);
  assert.doesNotMatch(html, /data-action="stop"/);
  assert.equal((html.match(/data-state="done"/g) ?? []).length, 3); // the launch and both ranks
});

test('a rank on another machine (a Ray launch) shows its node beside its pid', () => {
  const model = new LaunchModel();
  model.apply({ type: 'event', launch: 1, event: 'LaunchStarted', num_processes: 2, start_method: 'ray' }, 0);
  model.apply({ type: 'event', launch: 1, event: 'RankStarted', rank: 0, pid: 31, node: '10.0.0.7 (a1b2c3d4)' }, 0);
  model.apply({ type: 'event', launch: 1, event: 'RankStarted', rank: 1, pid: 32, node: '<b>' }, 0);
  const html = renderPanel(model, 'nb.ipynb', 1000);
  assert.match(html, /<td>31 on 10\.0\.0\.7 \(a1b2c3d4\)<\/td>/);
  assert.match(html, /<td>32 on &lt;b&gt;<\/td>/); // escaped
  model.apply({ type: 'event', launch: 2, event: 'RankStarted', rank: 0, pid: 40 }, 0);
  assert.match(renderPanel(model, 'nb.ipynb', 1000), /<td>40<\/td>/); // a local rank: its pid alone
});

test('the session: per-rank rows with Restart and Stop session; none: a Start button', () => {
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: { accelerators: [] }, preview: null, session: null });
  let html = renderPanel(model, 'nb.ipynb');
  assert.match(html, /No session running/);
  assert.match(html, /data-action="start_session"/);
  const ranks = [0, 1].map(rank => ({ rank, pid: 50 + rank, state: rank ? 'dead' : 'idle', device: 'cuda:0' }));
  model.apply({ type: 'session', id: 4, state: 'running', workers: 2, start_method: 'fork', ranks });
  html = renderPanel(model, 'nb.ipynb');
  assert.match(html, /Session 4: 2 workers \(fork\)/);
  assert.match(html, /data-action="restart"/);
  assert.match(html, /data-action="stop_session"/);
  assert.doesNotMatch(html, /data-action="start_session"/);
  assert.equal((html.match(/class="nacc-x-srank"/g) ?? []).length, 2);
  assert.match(html, /data-rank="1" data-state="dead"/);
  assert.match(html, /cuda:0/);
  model.apply({ type: 'session', id: 4, state: 'restarting', workers: 2, ranks });
  html = renderPanel(model, 'nb.ipynb');
  assert.doesNotMatch(html, /data-action="restart"/); // no second restart while one runs
  model.apply({ type: 'session', id: 4, state: 'stopped', workers: 2, ranks: [] });
  html = renderPanel(model, 'nb.ipynb');
  assert.match(html, /data-session="4" data-state="stopped"/);
  assert.match(html, /data-action="start_session"/);
  assert.doesNotMatch(html, /data-action="stop_session"/);
});

test('not connected: no session section', () => {
  assert.doesNotMatch(renderPanel(new LaunchModel(), 'nb.ipynb'), /Session/);
});

test('a running launch shows its notice; a finished one does not', () => {
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: null, preview: null });
  model.apply({ type: 'event', launch: 1, event: 'LaunchStarted', num_processes: 1, start_method: 'fork' }, 0);
  model.apply({ type: 'event', launch: 1, event: 'LaunchNotice', text: 'waiting for <node 1>' }, 0);
  assert.match(renderPanel(model, 'nb.ipynb', 0), /class="nacc-x-detail nacc-x-notice">waiting for &lt;node 1&gt;</);
  model.apply({ type: 'event', launch: 1, event: 'LaunchFinished', ok: false, seconds: 600, stopped: '' }, 0);
  assert.doesNotMatch(renderPanel(model, 'nb.ipynb', 0), /nacc-x-notice/);
});

// As HardwareReport.to_dict() sends it (notebook_accel/hardware.py).
const HARDWARE = {
  cpu_model: 'AMD EPYC 9654',
  physical_cores: 96,
  logical_cores: 192,
  ram_total: 64 * 2 ** 30,
  ram_available: 16 * 2 ** 30,
  accelerators: [
    {
      kind: 'cuda', index: 0, name: 'NVIDIA H100 80GB HBM3', total_memory: 80 * 2 ** 30,
      free_memory: 60 * 2 ** 30, compute_capability: [9, 0],
      supports_bf16: true, supports_fp16: true, supports_fp8: true
    },
    {
      kind: 'cuda', index: 1, name: 'Tesla T4', total_memory: 16 * 2 ** 30, free_memory: 2 ** 30,
      compute_capability: [7, 5], supports_bf16: false, supports_fp16: true, supports_fp8: false
    }
  ],
  device_family: 'cuda',
  tpu: false,
  environment: 'colab',
  versions: { python: '3.11.9', torch: '2.5.1', cuda: '12.4', torch_xla: null, notebook_accel: '0.1.0' }
};
const PREVIEW = {
  rows: [['Distributed type', 'MULTI_GPU'], ['Processes', '2'], ['Mixed precision', 'bf16']],
  notes: ["from /home/me/accel.yaml: mixed_precision='bf16'"],
  error: null
};

function hardwareHtml(hardware: object, preview: object | null = PREVIEW): string {
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware, preview });
  return renderPanel(model, 'nb.ipynb', 0);
}

/** The table cell after the header `name`, as text. */
function cellAfter(html: string, name: string): string {
  const m = html.match(new RegExp(`<th>${name}</th><td>(.*?)</td>`));
  assert.ok(m, `no row ${name}`);
  return m[1].replace(/<[^>]*>/g, '');
}

test('the hardware section: environment, CPU, RAM used of total, device family, TPU', () => {
  const html = hardwareHtml(HARDWARE);
  assert.equal(cellAfter(html, 'Environment'), 'Google Colab');
  assert.equal(cellAfter(html, 'CPU'), 'AMD EPYC 9654 · 96 physical / 192 logical cores');
  assert.equal(cellAfter(html, 'RAM'), '48.0 / 64.0 GiB used');
  assert.match(html, /class="nacc-x-bar" title="75%"/);
  assert.equal(cellAfter(html, 'Device family'), 'cuda');
  assert.equal(cellAfter(html, 'TPU'), 'no');
  // An environment the widget has no name for is shown as sent; CPU only says so.
  const cpuOnly = { ...HARDWARE, environment: 'jupyterlab', accelerators: [], device_family: null, tpu: true };
  const cpu = hardwareHtml(cpuOnly);
  assert.equal(cellAfter(cpu, 'Environment'), 'JupyterLab');
  assert.equal(cellAfter(cpu, 'Device family'), 'none (CPU only)');
  assert.equal(cellAfter(cpu, 'TPU'), 'yes');
  assert.match(cpu, /none: CPU only/);
  assert.equal(cellAfter(hardwareHtml({ ...HARDWARE, environment: 'sagemaker' }), 'Environment'), 'sagemaker');
});

test('each accelerator: memory used of total, capability, bf16 / fp16 / fp8 support', () => {
  const html = hardwareHtml(HARDWARE);
  const row = (device: string) => {
    const m = html.match(new RegExp(`<tr class="nacc-x-device" data-device="${device}">(.*?)</tr>`));
    assert.ok(m, `no row for ${device}`);
    return m[1];
  };
  const h100 = row('cuda:0');
  assert.match(h100, /NVIDIA H100 80GB HBM3/);
  assert.match(h100, /20\.0 \/ 80\.0 GiB used/);
  assert.match(h100, /<td>9\.0<\/td>/);
  for (const t of ['bf16', 'fp16', 'fp8']) {
    assert.match(h100, new RegExp(`nacc-x-badge-on" title="${t} supported"`));
  }
  const t4 = row('cuda:1');
  assert.match(t4, /15\.0 \/ 16\.0 GiB used/);
  assert.match(t4, /nacc-x-bar-fill nacc-x-high/); // 94 % used: the warning colour
  assert.match(t4, /nacc-x-badge-off" title="bf16 not supported"/);
  assert.match(t4, /nacc-x-badge-on" title="fp16 supported"/);
  assert.match(t4, /nacc-x-badge-off" title="fp8 not supported"/);
  // Memory unknown, or free memory unknown: no bar.
  const bare = hardwareHtml({
    ...HARDWARE,
    accelerators: [
      { kind: 'mps', index: 0, name: 'Apple M2', total_memory: null, free_memory: null, compute_capability: null },
      { kind: 'xpu', index: 0, name: 'Arc', total_memory: 2 ** 34, free_memory: null, compute_capability: null }
    ]
  });
  assert.match(bare, /data-device="mps:0"><td>mps:0<\/td><td>Apple M2<\/td><td>-<\/td><td>-<\/td>/);
  assert.match(bare, /<td>16\.0 GiB<\/td>/);
  assert.equal((bare.match(/nacc-x-badge-off/g) ?? []).length, 6);
});

test('versions, as the widget lists them; a missing one is "-"', () => {
  const html = hardwareHtml(HARDWARE);
  assert.match(html, /<div class="nacc-x-section">Versions<\/div>/);
  assert.equal(cellAfter(html, 'Python'), '3.11.9');
  assert.equal(cellAfter(html, 'torch'), '2.5.1');
  assert.equal(cellAfter(html, 'CUDA \\(torch build\\)'), '12.4');
  assert.equal(cellAfter(html, 'torch_xla'), '-');
  assert.equal(cellAfter(html, 'notebook_accel'), '0.1.0');
});

test('what a launch here would use: the preview rows and its notes; or why it would fail', () => {
  const html = hardwareHtml(HARDWARE);
  assert.match(html, /A launch here would use/);
  assert.equal(cellAfter(html, 'Distributed type'), 'MULTI_GPU');
  assert.equal(cellAfter(html, 'Mixed precision'), 'bf16');
  const note = '<div class="nacc-x-muted nacc-x-note">from /home/me/accel.yaml: mixed_precision=\'bf16\'</div>';
  assert.ok(html.includes(note), html);
  const failing = hardwareHtml(HARDWARE, { rows: [], notes: [], error: 'no free port' });
  assert.match(failing, /class="nacc-x-error">a launch here would fail: no free port/);
  assert.doesNotMatch(failing, /nacc-x-note/);
  // A broken config file is named once, whether or not the preview already says so.
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: HARDWARE, preview: PREVIEW, config_error: 'config file x: bad' });
  assert.equal((renderPanel(model, 'nb', 0).match(/config file x: bad/g) ?? []).length, 1);
  model.apply({ type: 'hello', hardware: HARDWARE, preview: { rows: [], notes: [], error: 'config file x: bad' },
    config_error: 'config file x: bad' });
  assert.equal((renderPanel(model, 'nb', 0).match(/config file x: bad/g) ?? []).length, 1);
});

test('rank rows say RSS and CPU while running, peaks once ended; the device only with NVML numbers', () => {
  const model = new LaunchModel();
  const mib = 2 ** 20;
  model.apply({ type: 'event', launch: 1, event: 'LaunchStarted', num_processes: 2, start_method: 'fork' }, 0);
  for (const rank of [0, 1]) {
    model.apply({ type: 'event', launch: 1, event: 'RankStarted', rank, pid: 10 + rank }, 0);
  }
  model.apply({ type: 'event', launch: 1, event: 'RankResources', rank: 0, rss: 300 * mib, cpu_percent: 97.6,
    memory_limit: 2 ** 30, device_memory: null, device_util: null }, 10);
  let html = renderPanel(model, 'nb.ipynb', 20);
  assert.match(html, /RSS <span class="nacc-x-rss" data-rank="0" title="resident memory of 1\.0 GiB allowed">300\.0 MiB<\/span>/);
  assert.match(html, / · CPU <span class="nacc-x-cpu" data-rank="0" title="100 % = one core">98 %</);
  assert.doesNotMatch(html, /device|data-rank="1" title/); // no NVML numbers; rank 1 not sampled yet
  model.apply({ type: 'event', launch: 1, event: 'RankFinished', rank: 0, seconds: 1, peak_rss: 310 * mib }, 30);
  model.apply({ type: 'event', launch: 1, event: 'RankResources', rank: 0, rss: mib, cpu_percent: 0 }, 31); // late
  model.apply({ type: 'event', launch: 1, event: 'RankResources', rank: 1, rss: mib, cpu_percent: 50,
    device_memory: 3 * 2 ** 30, device_util: 88 }, 32);
  html = renderPanel(model, 'nb.ipynb', 40);
  assert.match(html, /RSS <span class="nacc-x-rss" data-rank="0">peak 310\.0 MiB</);
  assert.doesNotMatch(html, /nacc-x-cpu" data-rank="0"/);
  assert.match(html, /device <span class="nacc-x-device-memory" data-rank="1">3\.0 GiB<\/span> <span class="nacc-x-device-util" data-rank="1">88 %</);
  model.apply({ type: 'event', launch: 1, event: 'RankFailed', rank: 1, summary: 'rank 1 was killed (SIGKILL), out of memory',
    peak_rss: 900 * mib, peak_device_memory: 5 * 2 ** 30 }, 50);
  html = renderPanel(model, 'nb.ipynb', 60);
  assert.match(html, /RSS <span class="nacc-x-rss" data-rank="1">peak 900\.0 MiB<\/span> · device <span class="nacc-x-device-memory" data-rank="1">peak 5\.0 GiB</);
  assert.match(html, /rank 1 was killed \(SIGKILL\), out of memory/);
});

test('an FSDP launch says so in its header; a plain one does not', () => {
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: { accelerators: [] }, preview: null });
  model.apply({ type: 'event', launch: 1, event: 'LaunchStarted', num_processes: 2, start_method: 'fork', fsdp: true }, 0);
  assert.match(renderPanel(model, 'nb.ipynb', 100), /2 processes \(fork\) <span class="nacc-x-fsdp">FSDP<\/span>/);
  model.apply({ type: 'event', launch: 2, event: 'LaunchStarted', num_processes: 2, start_method: 'fork', fsdp: false }, 0);
  const html = renderPanel(model, 'nb.ipynb', 100);
  assert.equal((html.match(/nacc-x-fsdp/g) ?? []).length, 1); // launch 1's only
});

test('a stall: the sentence on the launch, stalled ranks marked while they run, the report folded', () => {
  const model = new LaunchModel();
  model.apply({ type: 'hello', hardware: { accelerators: [] }, preview: null });
  model.apply({ type: 'event', launch: 3, event: 'LaunchStarted', num_processes: 2, start_method: 'fork' }, 0);
  for (const rank of [0, 1]) {
    model.apply({ type: 'event', launch: 3, event: 'RankStarted', rank, pid: 10 + rank }, 0);
  }
  const stall = {
    sentence: 'stalled for 2 s: rank 0 waits in all_reduce #1 (float32[4]); rank 1 waits in <barrier> #1',
    stalled: true,
    seconds: 2,
    ranks: [
      { rank: 0, state: 'waiting', doing: 'waits in all_reduce #1 (float32[4]) at Cell In[2], line 6, in f' },
      { rank: 1, state: 'waiting', doing: 'waits in barrier #1' }
    ],
    text: 'rank 0: waits in all_reduce #1\nThread 0x1:\n  Cell In[2], line 6, in f\n    dist.all_reduce(t)'
  };
  model.apply({ type: 'event', launch: 3, event: 'LaunchStalled', stall }, 2000);
  let html = renderPanel(model, 'nb.ipynb', 2500);
  assert.match(html, /class="nacc-x-launch" data-launch="3" data-state="running" data-stalled="1"/);
  assert.match(html, /<div class="nacc-x-stall" data-stalled="1"><div class="nacc-x-stall-sentence">.*stalled for 2 s: rank 0 waits in all_reduce #1 \(float32\[4\]\); rank 1 waits in &lt;barrier&gt; #1<\/div>/);
  assert.match(html, /<details class="nacc-x-stall-report" data-fold="stall-3"><summary>where each rank is<\/summary><pre class="nacc-x-stall-text">rank 0: waits in all_reduce #1\nThread 0x1:\n  Cell In\[2\], line 6, in f\n    dist\.all_reduce\(t\)<\/pre><\/details>/);
  assert.equal((html.match(/class="nacc-x-rank" data-rank="\d" data-state="running" data-stalled="1"/g) ?? []).length, 2);
  assert.match(html, /stalled: waits in all_reduce #1 \(float32\[4\]\) at Cell In\[2\], line 6, in f/);
  assert.equal((html.match(/nacc-x-stall-mark/g) ?? []).length, 2);
  // A fold the person opened stays open when the sidebar redraws.
  assert.match(renderPanel(model, 'nb.ipynb', 2500, new Set(['stall-3'])), /data-fold="stall-3" open>/);

  // Rank 1 stopped: no longer marked; once resumed, nothing of the stall is shown.
  model.apply({ type: 'event', launch: 3, event: 'RankStopped', rank: 1, reason: 'stopped' }, 2600);
  html = renderPanel(model, 'nb.ipynb', 2700);
  assert.equal((html.match(/data-stalled="1"/g) ?? []).length, 3); // the launch, its block and rank 0
  assert.doesNotMatch(html, /stalled: waits in barrier/);
  model.apply({ type: 'event', launch: 3, event: 'LaunchResumed', stall: null }, 3000);
  html = renderPanel(model, 'nb.ipynb', 3500);
  assert.doesNotMatch(html, /stall/);

  // A report without text (a page that missed it): the sentence, no fold.
  model.apply({ type: 'event', launch: 4, event: 'LaunchStalled', stall: { ...stall, text: undefined } }, 4000);
  html = renderPanel(model, 'nb.ipynb', 4500);
  assert.match(html, /data-launch="4"[^>]*data-stalled="1"/);
  assert.doesNotMatch(html, /data-fold="stall-4"/);
});
