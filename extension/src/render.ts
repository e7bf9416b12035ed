// The sidebar's HTML from a LaunchModel. Plain strings (every value escaped) so node can test it.

import { formatSeconds, LaunchModel, LaunchView, RankView, SessionView } from './model';

export const SHOWN_LINES = 5;

export function esc(value: unknown): string {
  return String(value ?? '')
    .replace(/&/g, '&amp;')
    .replace(/</g, '&lt;')
    .replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;');
}

function table(rows: [string, string][]): string {
  const body = rows.map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(v)}</td></tr>`).join('');
  return `<table class="nacc-x-table">${body}</table>`;
}

function gib(bytes: number | null | undefined): string {
  return bytes ? (bytes / 2 ** 30).toFixed(1) : '?';
}

export function renderHardware(model: LaunchModel): string {
  const hello = model.hello;
  if (!hello) {
    return (
      '<div class="nacc-x-muted">Not connected. Run <code>%load_ext notebook_accel</code> ' +
      'in a Python notebook.</div>'
    );
  }
  const hw = hello.hardware ?? {};
  const rows: [string, string][] = [
    ['CPU', `${hw.cpu_model ?? '?'} · ${hw.logical_cores ?? '?'} cores`],
    ['RAM', `${gib(hw.ram_total)} GiB`]
  ];
  for (const a of hw.accelerators ?? []) {
    rows.push([`${a.kind}:${a.index}`, `${a.name} · ${gib(a.total_memory)} GiB`]);
  }
  if (!(hw.accelerators ?? []).length) {
    rows.push(['Accelerators', 'none (CPU only)']);
  }
  if (hw.versions) {
    rows.push(['torch', hw.versions.torch ?? '-']);
  }
  let out = table(rows);
  if (hello.hardware_error) {
    out += `<div class="nacc-x-error">hardware probe failed: ${esc(hello.hardware_error)}</div>`;
  }
  const preview = hello.preview;
  if (preview?.error) {
    out += `<div class="nacc-x-error">a launch here would fail: ${esc(preview.error)}</div>`;
  } else if (preview) {
    out += '<div class="nacc-x-section">A launch here would use</div>' + table(preview.rows);
  }
  return out;
}

function rankElapsed(r: RankView, now: number): number {
  return r.seconds ?? (now - r.startedAt) / 1000;
}

function renderRank(r: RankView, now: number): string {
  const lines = r.lines.slice(-SHOWN_LINES);
  const text = lines.map(l => `<div class="nacc-x-line nacc-x-${esc(l.stream)}">${esc(l.text)}</div>`).join('');
  const dropped = r.dropped + r.lines.length - lines.length;
  const more = dropped > 0 ? `<div class="nacc-x-muted">${dropped} earlier lines not shown</div>` : '';
  const detail = r.detail ? `<div class="nacc-x-detail">${esc(r.detail)}</div>` : '';
  return (
    `<tr class="nacc-x-rank" data-rank="${r.rank}" data-state="${r.state}">` +
    `<td>${r.rank}</td><td><span class="nacc-x-state nacc-x-${r.state}">${r.state}</span></td>` +
    `<td>${r.pid ?? '-'}</td><td>${formatSeconds(rankElapsed(r, now))}</td></tr>` +
    `<tr class="nacc-x-output"><td colspan="4">${detail}${more}${text}</td></tr>`
  );
}

export function renderLaunch(launch: LaunchView, now: number, current: boolean): string {
  const f = launch.finished;
  const state = !f ? 'running' : f.stopped ? 'stopped' : f.ok ? 'done' : 'failed';
  const took = f ? formatSeconds(f.seconds) : formatSeconds((now - launch.startedAt) / 1000);
  const how = launch.startMethod ? ` (${esc(launch.startMethod)})` : '';
  const stop =
    current && !f ? '<button class="jp-Button nacc-x-stop" data-action="stop">Stop</button>' : '';
  const ranks = [...launch.ranks.values()].sort((a, b) => a.rank - b.rank);
  return (
    `<div class="nacc-x-launch" data-launch="${launch.id}" data-state="${state}">` +
    `<div class="nacc-x-launch-head"><span>Launch ${launch.id}: ${launch.numProcesses || ranks.length} ` +
    `processes${how}</span> <span class="nacc-x-state nacc-x-${state}">${state}</span> ` +
    `<span class="nacc-x-muted">${took}</span>${stop}</div>` +
    (f?.stopped ? `<div class="nacc-x-detail">${esc(f.stopped)}</div>` : '') +
    (!f && launch.notice ? `<div class="nacc-x-detail nacc-x-notice">${esc(launch.notice)}</div>` : '') +
    '<table class="nacc-x-table nacc-x-ranks"><tr><th>rank</th><th>state</th><th>pid</th><th>elapsed</th></tr>' +
    ranks.map(r => renderRank(r, now)).join('') +
    '</table></div>'
  );
}

function button(action: string, label: string, extra = ''): string {
  return `<button class="jp-Button nacc-x-${action}${extra}" data-action="${action}">${label}</button>`;
}

export function renderSession(s: SessionView, live: boolean): string {
  const how = s.startMethod ? ` (${esc(s.startMethod)})` : '';
  const restarts = s.restarts ? ` <span class="nacc-x-muted">restarted ${s.restarts}x</span>` : '';
  const buttons =
    live && s.state === 'running'
      ? '<div class="nacc-x-actions">' +
        button('restart', 'Restart') +
        button('stop_session', 'Stop session', ' nacc-x-stop') +
        '</div>'
      : '';
  const rows = s.ranks
    .map(
      r =>
        `<tr class="nacc-x-srank" data-rank="${esc(r.rank)}" data-state="${esc(r.state)}">` +
        `<td>${esc(r.rank)}</td><td><span class="nacc-x-state nacc-x-${esc(r.state)}">${esc(r.state)}</span></td>` +
        `<td>${esc(r.pid ?? '-')}</td><td>${esc(r.device || '-')}</td></tr>`
    )
    .join('');
  const table = live
    ? '<table class="nacc-x-table nacc-x-ranks"><tr><th>rank</th><th>state</th><th>pid</th><th>device</th></tr>' +
      rows +
      '</table>'
    : '';
  return (
    `<div class="nacc-x-session" data-session="${esc(s.id)}" data-state="${esc(s.state)}">` +
    `<div class="nacc-x-session-head"><span>Session ${esc(s.id)}: ${esc(s.workers)} workers${how}</span> ` +
    `<span class="nacc-x-state nacc-x-${esc(s.state)}">${esc(s.state)}</span>${restarts}</div>` +
    table +
    buttons +
    '</div>'
  );
}

export function renderSessions(model: LaunchModel): string {
  if (!model.connected) {
    return '';
  }
  const live = model.session;
  const start = live
    ? ''
    : '<div class="nacc-x-muted nacc-x-nosession">No session running. ' +
      button('start_session', 'Start session') +
      '</div>';
  return start + model.sessions.map(s => renderSession(s, s === live)).join('');
}

export function renderPanel(model: LaunchModel, title: string, now: number = Date.now()): string {
  const launches = model.launches.length
    ? model.launches.map((l, i) => renderLaunch(l, now, i === 0)).join('')
    : '<div class="nacc-x-muted">No launch yet.</div>';
  const refresh = model.connected
    ? '<button class="jp-Button nacc-x-refresh" data-action="refresh">Refresh</button>'
    : '<button class="jp-Button nacc-x-refresh" data-action="connect">Connect</button>';
  return (
    `<div class="nacc-x-title">notebook_accel <span class="nacc-x-muted">${esc(title)}</span>${refresh}</div>` +
    '<div class="nacc-x-section">Hardware</div>' +
    renderHardware(model) +
    (model.connected ? '<div class="nacc-x-section">Session</div>' + renderSessions(model) : '') +
    '<div class="nacc-x-section">Launches</div>' +
    launches
  );
}
