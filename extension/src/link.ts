// One notebook's link to its kernel's "notebook_accel" comm target.

import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import { LaunchModel } from './model';

export const TARGET = 'notebook_accel';

export class KernelLink {
  readonly model = new LaunchModel();
  private _changed = new Signal<this, void>(this);
  private comm: Kernel.IComm | null = null;
  private opening = false;
  // Try to open only at kernel start and after a cell that names the package: a kernel without
  // the target logs an error for every failed open.
  private wanted = true;

  constructor(readonly context: ISessionContext) {
    context.kernelChanged.connect(this.restart, this);
    context.statusChanged.connect(this.onStatus, this);
    context.iopubMessage.connect(this.onIOPub, this);
    void this.tryOpen();
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Ask again now (the sidebar's Connect button). */
  connect(): void {
    this.wanted = true;
    void this.tryOpen();
  }

  send(data: { type: string }): boolean {
    if (!this.comm || this.comm.isDisposed) {
      return false;
    }
    this.comm.send(data as any);
    return true;
  }

  dispose(): void {
    Signal.clearData(this);
    this.comm = null;
  }

  private restart(): void {
    this.comm = null;
    this.model.reset();
    this.wanted = true;
    this._changed.emit();
  }

  private onStatus(_: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      this.restart();
    } else if (status === 'idle') {
      void this.tryOpen();
    }
  }

  private onIOPub(_: ISessionContext, msg: KernelMessage.IMessage): void {
    if (msg.header.msg_type === 'execute_input' && !this.comm) {
      const code = String((msg.content as any).code ?? '');
      if (code.includes('notebook_accel')) {
        this.wanted = true;
      }
    }
  }

  private async tryOpen(): Promise<void> {
    const kernel = this.context.session?.kernel;
    if (!kernel || this.comm || this.opening || !this.wanted) {
      return;
    }
    this.opening = true;
    this.wanted = false;
    try {
      const info = await kernel.info;
      if (info.language_info.name !== 'python' || kernel !== this.context.session?.kernel) {
        return;
      }
      const comm = kernel.createComm(TARGET);
      comm.onMsg = msg => {
        if (this.model.apply(msg.content.data)) {
          this._changed.emit();
        }
      };
      comm.onClose = () => {
        // The kernel closes at once when its target is not registered (extension not loaded).
        if (this.comm === comm) {
          this.comm = null;
          this.model.reset();
          this._changed.emit();
        }
      };
      this.comm = comm;
      await comm.open({}).done;
    } catch (err) {
      this.comm = null;
      console.debug('notebook_accel: no comm', err);
    } finally {
      this.opening = false;
    }
  }
}
