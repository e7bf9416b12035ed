// What the kernel's "notebook_accel" comm has said, folded into plain state.
// No JupyterLab imports here: the unit tests run this under plain node.

export interface Preview {
  rows: [string, string][];
  notes: string[];
  error: string | null;
}

/** What the kernel's config file gives a launch (comm.py's launch_defaults); null where it gives none. */
export interface LaunchDefaults {
  file: string | null;
  num_processes: number | null;
  mixed_precision: string | null;
}

export interface Hello {
  type: 'hello';
  version?: string;
  hardware: any;
  hardware_error?: string;
  preview: Preview | null;
  session?: SessionMessage | null;
  config?: LaunchDefaults | null; // absent from older kernels
  config_error?: string;
}

/** What comm.py's session_message sends. Rank states: idle, busy, dead, stopped. */
export interface SessionMessage {
  type: 'session';
  id: number;
  state: 'running' | 'restarting' | 'stopped';
  workers: number;
  start_method?: string;
  ranks: { rank: number; pid: number | null; state: string; device?: string | null }[];
}

export interface SessionView {
  id: number;
  state: SessionMessage['state'];
  workers: number;
  startMethod: string;
  ranks: SessionMessage['ranks'];
  startedAt: number; // ms, this browser's clock: when we first heard of it
  restarts: number; // new pids seen since then
}

export interface Notice {
  level: 'info' | 'warning' | 'error';
  text: string;
}

export type RankState = 'running' | 'done' | 'failed' | 'stopped';

/** A RankResources event's numbers (bytes, %); device ones null without NVML. */
export interface RankUsage {
  rss: number;
  cpu: number;
  limit: number | null;
  deviceMemory: number | null;
  deviceUtil: number | null;
}

/** What RankFinished / RankFailed say a rank peaked at (bytes), null where unknown. */
export interface RankPeaks {
  rss: number | null;
  deviceMemory: number | null;
}

export interface RankView {
  rank: number;
  state: RankState;
  pid?: number;
  node?: string; // the rank's machine, where the launch names it (Ray): its pid is that machine's
  startedAt: number; // ms, this browser's clock
  seconds?: number; // set when the rank ended
  detail: string;
  lines: { stream: string; text: string; transient: boolean }[];
  dropped: number;
  usage?: RankUsage; // the newest sample while it runs
  peaks?: RankPeaks; // once it ended
}

/** One rank in a stall report (comm.py's stall_fields): "waiting", "running", "returned", ... */
export interface StallRank {
  rank: number;
  state: string;
  doing: string; // "waits in all_reduce #3 (float32[4]) at Cell In[5], line 3, in f"
}

/** The stall going on (LaunchStalled), until a rank moves (LaunchResumed). */
export interface StallView {
  sentence: string;
  stalled: boolean; // some rank waits in a collective (else: no progress, in none)
  seconds: number;
  ranks: StallRank[];
  text: string; // the whole report: each rank's stacks ('' if the kernel sent none)
}

export interface LaunchView {
  id: number;
  startedAt: number;
  numProcesses: number;
  startMethod: string;
  fsdp?: boolean; // the ranks shard models with FSDP (LaunchStarted.fsdp)
  ranks: Map<number, RankView>;
  notice?: string; // "waiting for the other nodes ...", until a rank starts
  finished?: { ok: boolean; seconds: number; stopped: string; failedRanks: number[] };
  stall?: StallView; // kept once the launch ended, as the launch panel keeps it: it says why
  stallText?: string; // the report text last sent: the kernel sends it again only when it changes
}

export const KEEP_LAUNCHES = 5;
export const KEEP_LINES = 50;
export const KEEP_SESSIONS = 3;

export class LaunchModel {
  hello: Hello | null = null;
  launches: LaunchView[] = []; // newest first
  sessions: SessionView[] = []; // newest first
  notices: Notice[] = []; // not shown yet: takeNotices()

  get connected(): boolean {
    return this.hello !== null;
  }

  get current(): LaunchView | undefined {
    return this.launches[0];
  }

  /** The kernel's live session (running or restarting), if any. */
  get session(): SessionView | undefined {
    const s = this.sessions[0];
    return s && s.state !== 'stopped' ? s : undefined;
  }

  /** Forget everything (a new or restarted kernel). */
  reset(): void {
    this.hello = null;
    this.launches = [];
    this.sessions = [];
    this.notices = [];
  }

  takeNotices(): Notice[] {
    const notices = this.notices;
    this.notices = [];
    return notices;
  }

  /** Fold one comm message in; false when it was not one of ours. */
  apply(msg: any, now: number = Date.now()): boolean {
    if (!msg || typeof msg !== 'object') {
      return false;
    }
    if (msg.type === 'hello') {
      this.hello = msg as Hello;
      // The kernel's word on its session: any other one we show as live has ended.
      const live = msg.session?.type === 'session' ? msg.session.id : null;
      for (const s of this.sessions) {
        if (s.id !== live && s.state !== 'stopped') {
          s.state = 'stopped';
          s.ranks = s.ranks.map(r => ({ ...r, state: 'stopped' }));
        }
      }
      if (live !== null) {
        this.applySession(msg.session, now);
      }
      return true;
    }
    if (msg.type === 'session' && typeof msg.id === 'number') {
      this.applySession(msg as SessionMessage, now);
      return true;
    }
    if (msg.type === 'notice' && typeof msg.text === 'string') {
      const level = ['info', 'warning', 'error'].includes(msg.level) ? msg.level : 'info';
      this.notices.push({ level, text: msg.text });
      return true;
    }
    if (msg.type !== 'event' || typeof msg.launch !== 'number') {
      return false;
    }
    const launch = this.launch(msg.launch, now);
    switch (msg.event) {
      case 'LaunchStarted':
        launch.numProcesses = msg.num_processes;
        launch.startMethod = msg.start_method;
        launch.fsdp = msg.fsdp === true;
        return true;
      case 'RankStarted':
        launch.ranks.set(msg.rank, newRank(msg.rank, now, msg.pid, typeof msg.node === 'string' ? msg.node : ''));
        launch.notice = undefined;
        return true;
      case 'LaunchNotice':
        launch.notice = typeof msg.text === 'string' ? msg.text : undefined;
        return true;
      case 'RankOutput':
        addLines(rankOf(launch, msg.rank, now), msg.lines ?? [], msg.dropped ?? 0);
        return true;
      case 'RankResources': {
        const r = rankOf(launch, msg.rank, now);
        if (r.state === 'running') {
          r.usage = {
            rss: num(msg.rss) ?? 0,
            cpu: num(msg.cpu_percent) ?? 0,
            limit: num(msg.memory_limit),
            deviceMemory: num(msg.device_memory),
            deviceUtil: num(msg.device_util)
          };
        }
        return true;
      }
      case 'RankFinished':
        endRank(rankOf(launch, msg.rank, now), 'done', '', now, msg);
        return true;
      case 'RankFailed':
        endRank(rankOf(launch, msg.rank, now), 'failed', msg.summary ?? '', now, msg);
        return true;
      case 'RankStopped':
        endRank(rankOf(launch, msg.rank, now), 'stopped', msg.reason ?? '', now);
        return true;
      case 'LaunchStalled':
        launch.stall = stallOf(msg.stall, launch.stallText);
        launch.stallText = launch.stall?.text ?? launch.stallText;
        return true;
      case 'LaunchResumed':
        launch.stall = undefined;
        return true;
      case 'LaunchFinished':
        launch.finished = {
          ok: !!msg.ok,
          seconds: msg.seconds ?? 0,
          stopped: msg.stopped ?? '',
          failedRanks: msg.failed_ranks ?? []
        };
        for (const r of launch.ranks.values()) {
          if (r.state === 'running') {
            endRank(r, 'stopped', launch.finished.stopped, now);
          }
        }
        return true;
      default:
        return false;
    }
  }

  private applySession(msg: SessionMessage, now: number): void {
    let s = this.sessions.find(x => x.id === msg.id);
    if (!s) {
      s = { id: msg.id, state: msg.state, workers: 0, startMethod: '', ranks: [], startedAt: now, restarts: 0 };
      this.sessions.unshift(s);
      this.sessions.sort((a, b) => b.id - a.id);
      this.sessions.length = Math.min(this.sessions.length, KEEP_SESSIONS);
    }
    const ranks = Array.isArray(msg.ranks) ? [...msg.ranks].sort((a, b) => a.rank - b.rank) : [];
    const pids = (rs: SessionMessage['ranks']) => rs.map(r => r.pid).join(',');
    if (msg.state === 'running' && s.ranks.length && ranks.length && pids(ranks) !== pids(s.ranks)) {
      s.restarts += 1;
    }
    s.state = msg.state;
    s.workers = msg.workers || ranks.length;
    s.startMethod = msg.start_method ?? s.startMethod;
    s.ranks = ranks;
  }

  private launch(id: number, now: number): LaunchView {
    let launch = this.launches.find(l => l.id === id);
    if (!launch) {
      // Also for a launch whose start we missed (the page opened mid-launch).
      launch = { id, startedAt: now, numProcesses: 0, startMethod: '', ranks: new Map() };
      this.launches.unshift(launch);
      this.launches.length = Math.min(this.launches.length, KEEP_LAUNCHES);
    }
    return launch;
  }
}

function newRank(rank: number, now: number, pid?: number, node = ''): RankView {
  return { rank, state: 'running', pid, node, startedAt: now, detail: '', lines: [], dropped: 0 };
}

function rankOf(launch: LaunchView, rank: number, now: number): RankView {
  let r = launch.ranks.get(rank);
  if (!r) {
    r = newRank(rank, now);
    launch.ranks.set(rank, r);
  }
  return r;
}

function addLines(r: RankView, lines: [string, string, boolean][], dropped: number): void {
  r.dropped += dropped;
  for (const [stream, text, transient] of lines) {
    const last = r.lines[r.lines.length - 1];
    if (last && last.transient && last.stream === stream) {
      r.lines.pop(); // a progress bar redraws itself
    }
    r.lines.push({ stream, text, transient: !!transient });
  }
  if (r.lines.length > KEEP_LINES) {
    r.dropped += r.lines.length - KEEP_LINES;
    r.lines.splice(0, r.lines.length - KEEP_LINES);
  }
}

function endRank(r: RankView, state: RankState, detail: string, now: number, msg?: any): void {
  r.state = state;
  r.detail = detail;
  r.seconds = (now - r.startedAt) / 1000;
  if (msg) {
    r.peaks = { rss: num(msg.peak_rss), deviceMemory: num(msg.peak_device_memory) };
  }
}

function stallOf(s: any, lastText: string | undefined): StallView | undefined {
  if (!s || typeof s !== 'object' || typeof s.sentence !== 'string') {
    return undefined;
  }
  const ranks: StallRank[] = (Array.isArray(s.ranks) ? s.ranks : [])
    .filter((r: any) => r && typeof r.rank === 'number')
    .map((r: any) => ({ rank: r.rank, state: String(r.state ?? ''), doing: String(r.doing ?? '') }));
  return {
    sentence: s.sentence,
    stalled: s.stalled === true,
    seconds: num(s.seconds) ?? 0,
    ranks,
    text: typeof s.text === 'string' ? s.text : lastText ?? ''
  };
}

function num(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

/** "266.3 MiB": sizes as the kernel's launch panel writes them (launch/oom.py's human_bytes). */
export function formatBytes(n: number | null | undefined): string {
  if (typeof n !== 'number') {
    return '';
  }
  for (const [unit, size] of [['GiB', 2 ** 30], ['MiB', 2 ** 20], ['KiB', 2 ** 10]] as [string, number][]) {
    if (n >= size) {
      return `${(n / size).toFixed(1)} ${unit}`;
    }
  }
  return `${n} B`;
}

export function formatSeconds(s: number): string {
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

/** N when neither the setting nor the config gives one. */
export const DEFAULT_PROCESSES = 2;

export type ProcessesSource = 'setting' | 'config' | 'default';

/**
 * N for "Run cell on N processes" and "Start / stop a session": the numProcesses setting when the
 * user gave one (1 or more); else (0, the schema's default) the kernel's config file's num_processes,
 * known from its hello; else DEFAULT_PROCESSES.
 */
export function chooseProcesses(
  setting: number | null | undefined,
  hello: Hello | null | undefined
): { n: number; from: ProcessesSource } {
  if (typeof setting === 'number' && Number.isInteger(setting) && setting >= 1) {
    return { n: setting, from: 'setting' };
  }
  const fromConfig = hello?.config?.num_processes;
  if (typeof fromConfig === 'number' && Number.isInteger(fromConfig) && fromConfig >= 1) {
    return { n: fromConfig, from: 'config' };
  }
  return { n: DEFAULT_PROCESSES, from: 'default' };
}

/** The precision a launch would use: the config's mixed_precision unless "no", else fp32. */
export function launchPrecision(hello: Hello): string {
  // A kernel without the config field: its launch preview shows the same value.
  const given = hello.config
    ? hello.config.mixed_precision
    : new Map(hello.preview?.rows ?? []).get('Mixed precision');
  return given && given !== 'no' ? given : 'fp32';
}

/** "2 x CPU · MULTI_CPU · fp32": what "Run cell on N processes" would use here. */
export function hardwareSummary(hello: Hello, numProcesses: number): string {
  const rows = new Map(hello.preview?.rows ?? []);
  const accelerators: any[] = hello.hardware?.accelerators ?? [];
  if (hello.preview?.error) {
    return `launch would fail: ${hello.preview.error}`;
  }
  let count = parseInt(rows.get('Processes') ?? '1', 10) || 1;
  let type = rows.get('Distributed type') ?? '?';
  const withN = [...rows.keys()].find(k => k.startsWith('With num_processes'));
  if (count === 1 && withN) {
    // One process is only the default without accelerators; the command asks for N.
    count = numProcesses;
    type = (rows.get(withN) ?? type).split(' ')[0];
  }
  const device = accelerators.length ? accelerators[0].name : 'CPU';
  return `${count} x ${device} · ${type} · ${launchPrecision(hello)}`;
}

/** The status bar's text for the active notebook's kernel. */
export function statusText(model: LaunchModel, numProcesses: number): string {
  if (!model.hello) {
    return 'not connected';
  }
  const launch = model.current;
  const session = model.session;
  const base = launch ? launchText(launch) : hardwareSummary(model.hello, numProcesses);
  if (session && !(launch && !launch.finished)) {
    const what = session.state === 'restarting' ? 'restarting' : `${session.workers} workers`;
    return `${base} · session: ${what}`;
  }
  return base;
}

function launchText(launch: LaunchView): string {
  const ranks = [...launch.ranks.values()].sort((a, b) => a.rank - b.rank);
  const failed = ranks.filter(r => r.state === 'failed').map(r => r.rank);
  if (failed.length) {
    return failed.length === 1 ? `rank ${failed[0]} failed` : `ranks ${failed.join(', ')} failed`;
  }
  if (launch.finished) {
    const took = formatSeconds(launch.finished.seconds);
    if (launch.finished.stopped) {
      return `stopped after ${took}`;
    }
    return launch.finished.ok ? `finished in ${took}` : `failed after ${took}`;
  }
  const total = launch.numProcesses || ranks.length;
  const running = ranks.filter(r => r.state === 'running').length;
  if (!running && launch.notice) {
    return 'waiting for the other nodes';
  }
  return `${running}/${total} ranks running`;
}
