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
