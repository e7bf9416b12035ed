// The sidebar's HTML from a LaunchModel. Plain strings (every value escaped) so node can test it.

import { formatBytes, formatSeconds, LaunchModel, LaunchView, RankView, SessionView, StallRank } from './model';

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

/** Like table(), but the values are HTML already (bars, badges). */
function htmlTable(rows: [string, string][]): string {
  const body = rows.map(([k, v]) => `<tr><th>${esc(k)}</th><td>${v}</td></tr>`).join('');
  return `<table class="nacc-x-table">${body}</table>`;
}

function gib(bytes: number | null | undefined): string {
  return typeof bytes === 'number' ? (bytes / 2 ** 30).toFixed(1) : '?';
}

// As the hardware widget (notebook_accel/jupyter/hardware_panel.py) names them.
export const ENVIRONMENT_NAMES: Record<string, string> = {
  colab: 'Google Colab',
  kaggle: 'Kaggle',
  vscode: 'VS Code',
  jupyterlab: 'JupyterLab',
  notebook: 'Jupyter Notebook',
  ipython: 'IPython terminal',
  terminal: 'terminal',
  script: 'script'
};
export const VERSION_NAMES: [string, string][] = [
  ['Python', 'python'],
  ['torch', 'torch'],
  ['CUDA (torch build)', 'cuda'],
  ['torch_xla', 'torch_xla'],
  ['notebook_accel', 'notebook_accel']
];
export const PRECISIONS = ['bf16', 'fp16', 'fp8'];

/** A usage bar (theme colours; the warning colour from 90 %) followed by `text`. */
export function bar(used: number | null | undefined, total: number | null | undefined, text: string): string {
  if (typeof used !== 'number' || typeof total !== 'number' || !total) {
    return esc(text);
  }
  const share = Math.min(Math.max(used / total, 0), 1);
  const colour = share >= 0.9 ? 'var(--jp-warn-color1)' : 'var(--jp-brand-color1)';
  return (
    `<span class="nacc-x-bar" title="${Math.round(share * 100)}%" style="display:inline-block;width:60px;` +
    'height:8px;margin-right:6px;vertical-align:middle;border-radius:2px;overflow:hidden;' +
    'background:var(--jp-layout-color3)">' +
    `<span class="nacc-x-bar-fill${share >= 0.9 ? ' nacc-x-high' : ''}" style="display:block;height:100%;` +
    `width:${(share * 100).toFixed(1)}%;background:${colour}"></span></span>${esc(text)}`
  );
}

/** "bf16" marked supported or not, as the widget's badges. */
export function badge(text: string, on: boolean): string {
  const look = on
    ? 'background:var(--jp-success-color1);color:var(--jp-ui-inverse-font-color1)'
    : 'color:var(--jp-ui-font-color3);text-decoration:line-through;border:1px solid var(--jp-border-color2)';
  return (
    `<span class="nacc-x-badge nacc-x-badge-${on ? 'on' : 'off'}" title="${esc(text)} ` +
    `${on ? 'supported' : 'not supported'}" style="padding:0 4px;margin-right:3px;border-radius:2px;${look}">` +
    `${esc(text)}</span>`
  );
}

function renderAccelerators(devices: any[]): string {
  if (!devices.length) {
    return '<div class="nacc-x-muted">none: CPU only</div>';
  }
  const rows = devices.map(d => {
    let memory = '-';
    if (d.total_memory && typeof d.free_memory === 'number') {
      const used = d.total_memory - d.free_memory;
      memory = bar(used, d.total_memory, `${gib(used)} / ${gib(d.total_memory)} GiB used`);
    } else if (d.total_memory) {
      memory = esc(`${gib(d.total_memory)} GiB`);
    }
    const capability = Array.isArray(d.compute_capability) ? d.compute_capability.join('.') : '-';
    const flags = PRECISIONS.map(t => badge(t, !!d[`supports_${t}`])).join('');
    const name = esc(`${d.kind}:${d.index}`);
    return (
      `<tr class="nacc-x-device" data-device="${name}"><td>${name}</td>` +
      `<td>${esc(d.name)}</td><td>${memory}</td><td>${esc(capability)}</td><td>${flags}</td></tr>`
    );
  });
  return (
    '<table class="nacc-x-table nacc-x-devices"><tr><th>device</th><th>name</th><th>memory</th>' +
    '<th>capability</th><th>precision</th></tr>' +
    rows.join('') +
    '</table>'
  );
}

/** The hardware widget's content: this machine, its accelerators, versions, and what a launch would use. */
export function renderHardware(model: LaunchModel): string {
  const hello = model.hello;
  if (!hello) {
    return (
      '<div class="nacc-x-muted">Not connected. Run <code>%load_ext notebook_accel</code> ' +
      'in a Python notebook.</div>'
    );
  }
  let out = '';
  const hw = hello.hardware;
  if (hw) {
    const environment = ENVIRONMENT_NAMES[hw.environment] ?? hw.environment ?? '?';
    const total = hw.ram_total;
    const available = hw.ram_available;
    const used = typeof total === 'number' && typeof available === 'number' ? total - available : null;
    const cores = hw.logical_cores ?? '?';
    const machine: [string, string][] = [
      ['Environment', esc(environment)],
      ['CPU', esc(`${hw.cpu_model ?? '?'} · ${hw.physical_cores ?? '?'} physical / ${cores} logical cores`)],
      ['RAM', bar(used, total, `${gib(used)} / ${gib(total)} GiB used`)],
      ['Device family', esc(hw.device_family || 'none (CPU only)')],
      ['TPU', hw.tpu ? 'yes' : 'no']
    ];
    const versions = hw.versions ?? {};
    out +=
      htmlTable(machine) +
      '<div class="nacc-x-section">Accelerators</div>' +
      renderAccelerators(Array.isArray(hw.accelerators) ? hw.accelerators : []) +
      '<div class="nacc-x-section">Versions</div>' +
      table(VERSION_NAMES.map(([name, key]) => [name, versions[key] || '-']));
  }
  if (hello.hardware_error) {
    out += `<div class="nacc-x-error">hardware probe failed: ${esc(hello.hardware_error)}</div>`;
  }
  const preview = hello.preview;
  if (preview) {
    out += '<div class="nacc-x-section">A launch here would use</div>';
    if (preview.error) {
      out += `<div class="nacc-x-error">a launch here would fail: ${esc(preview.error)}</div>`;
    } else {
      out += table(preview.rows);
      out += (preview.notes ?? []).map(note => `<div class="nacc-x-muted nacc-x-note">${esc(note)}</div>`).join('');
    }
  }
  if (hello.config_error && !preview?.error?.includes(hello.config_error)) {
    out += `<div class="nacc-x-error">config file: ${esc(hello.config_error)}</div>`;
  }
  return out;
}

function rankElapsed(r: RankView, now: number): number {
  return r.seconds ?? (now - r.startedAt) / 1000;
}

/** "RSS 188.3 MiB · CPU 97 %" (and the device's memory and utilisation where NVML gave them) while a
 * rank runs, "peak RSS ..." once it ended; on its own line: the sidebar is narrow. */
function usageLine(r: RankView): string {
  const span = (kind: string, text: string, title = '') =>
    `<span class="nacc-x-${kind}" data-rank="${r.rank}"${title ? ` title="${esc(title)}"` : ''}>${esc(text)}</span>`;
  const parts: string[] = [];
  if (r.state !== 'running') {
    if (typeof r.peaks?.rss === 'number') {
      parts.push(`RSS ${span('rss', `peak ${formatBytes(r.peaks.rss)}`)}`);
    }
    if (typeof r.peaks?.deviceMemory === 'number') {
      parts.push(`device ${span('device-memory', `peak ${formatBytes(r.peaks.deviceMemory)}`)}`);
    }
  } else if (r.usage) {
    const u = r.usage;
    const limit = u.limit ? `resident memory of ${formatBytes(u.limit)} allowed` : 'resident memory';
    parts.push(`RSS ${span('rss', formatBytes(u.rss), limit)}`);
    parts.push(`CPU ${span('cpu', `${Math.round(u.cpu)} %`, '100 % = one core')}`);
    if (typeof u.deviceMemory === 'number') {
      const util = typeof u.deviceUtil === 'number' ? ` ${span('device-util', `${Math.round(u.deviceUtil)} %`)}` : '';
      parts.push(`device ${span('device-memory', formatBytes(u.deviceMemory))}${util}`);
    }
  }
  return parts.length ? `<div class="nacc-x-usage">${parts.join(' · ')}</div>` : '';
}

/** `stalled`: where the stall report says this rank is; marked only while the rank runs (as the
 * kernel's launch model marks it), since a rank's end says more. */
function renderRank(r: RankView, now: number, stalled?: StallRank): string {
  const lines = r.lines.slice(-SHOWN_LINES);
  const text = lines.map(l => `<div class="nacc-x-line nacc-x-${esc(l.stream)}">${esc(l.text)}</div>`).join('');
  const dropped = r.dropped + r.lines.length - lines.length;
  const more = dropped > 0 ? `<div class="nacc-x-muted">${dropped} earlier lines not shown</div>` : '';
  const stall = r.state === 'running' ? stalled : undefined;
  const detail =
    (stall ? `<div class="nacc-x-detail nacc-x-stalled">stalled: ${esc(stall.doing)}</div>` : '') +
    (r.detail ? `<div class="nacc-x-detail">${esc(r.detail)}</div>` : '');
  const mark = stall ? ' <span class="nacc-x-stall-mark" title="no progress: see the report above">stalled</span>' : '';
  return (
    `<tr class="nacc-x-rank" data-rank="${r.rank}" data-state="${r.state}"${stall ? ' data-stalled="1"' : ''}>` +
    `<td>${r.rank}</td><td><span class="nacc-x-state nacc-x-${r.state}">${r.state}</span>${mark}</td>` +
    `<td>${esc(r.pid ?? '-')}${r.node ? ` on ${esc(r.node)}` : ''}</td><td>${formatSeconds(rankElapsed(r, now))}</td></tr>` +
    `<tr class="nacc-x-output"><td colspan="4">${usageLine(r)}${detail}${more}${text}</td></tr>`
  );
}

/** The stall's sentence on the launch's card, and the whole report folded. `open`: the folds
 * (data-fold) the person opened, kept open across redraws. */
function renderStall(launch: LaunchView, open: ReadonlySet<string>): string {
  const s = launch.stall;
  if (!s) {
    return '';
  }
  const fold = `stall-${launch.id}`;
  const report = s.text
    ? `<details class="nacc-x-stall-report" data-fold="${fold}"${open.has(fold) ? ' open' : ''}>` +
      `<summary>where each rank is</summary><pre class="nacc-x-stall-text">${esc(s.text)}</pre></details>`
    : '';
  return (
    `<div class="nacc-x-stall" data-stalled="${s.stalled ? 1 : 0}">` +
    `<div class="nacc-x-stall-sentence"><span class="nacc-x-stall-icon" aria-hidden="true">⚠</span> ` +
    `${esc(s.sentence)}</div>${report}</div>`
  );
}

export function renderLaunch(
  launch: LaunchView,
  now: number,
  current: boolean,
  open: ReadonlySet<string> = new Set()
): string {
  const f = launch.finished;
  const state = !f ? 'running' : f.stopped ? 'stopped' : f.ok ? 'done' : 'failed';
  const took = f ? formatSeconds(f.seconds) : formatSeconds((now - launch.startedAt) / 1000);
  const fsdp = launch.fsdp ? ' <span class="nacc-x-fsdp">FSDP</span>' : '';
  const how = (launch.startMethod ? ` (${esc(launch.startMethod)})` : '') + fsdp;
  const stop =
    current && !f ? '<button class="jp-Button nacc-x-stop" data-action="stop">Stop</button>' : '';
  const ranks = [...launch.ranks.values()].sort((a, b) => a.rank - b.rank);
  const where = new Map((launch.stall?.ranks ?? []).map(w => [w.rank, w]));
  return (
    `<div class="nacc-x-launch" data-launch="${launch.id}" data-state="${state}"` +
    `${launch.stall ? ' data-stalled="1"' : ''}>` +
    `<div class="nacc-x-launch-head"><span>Launch ${launch.id}: ${launch.numProcesses || ranks.length} ` +
    `processes${how}</span> <span class="nacc-x-state nacc-x-${state}">${state}</span> ` +
    `<span class="nacc-x-muted">${took}</span>${stop}</div>` +
    (f?.stopped ? `<div class="nacc-x-detail">${esc(f.stopped)}</div>` : '') +
    (!f && launch.notice ? `<div class="nacc-x-detail nacc-x-notice">${esc(launch.notice)}</div>` : '') +
    renderStall(launch, open) +
    '<table class="nacc-x-table nacc-x-ranks"><tr><th>rank</th><th>state</th><th>pid</th><th>elapsed</th></tr>' +
    ranks.map(r => renderRank(r, now, where.get(r.rank))).join('') +
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

/** `open`: the data-fold names of the <details> the person opened (the sidebar redraws every second). */
export function renderPanel(
  model: LaunchModel,
  title: string,
  now: number = Date.now(),
  open: ReadonlySet<string> = new Set()
): string {
  const launches = model.launches.length
    ? model.launches.map((l, i) => renderLaunch(l, now, i === 0, open)).join('')
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
