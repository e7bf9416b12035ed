import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { CodeCell } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { OutputArea } from '@jupyterlab/outputarea';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { CommandToolbarButton } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';
import { KernelLink } from './link';
import { acceleratorIcon } from './icon';
import { chooseProcesses, hardwareSummary, LaunchModel, statusText } from './model';
import { renderPanel } from './render';
import { runCellCode, toggleSessionCode } from './code';

const PLUGIN_ID = 'notebook-accel-labextension:plugin';
const PANEL_ID = 'notebook-accel-panel';

export const CommandIDs = {
  runCell: 'notebook-accel:run-cell',
  toggleSession: 'notebook-accel:toggle-session',
  openPanel: 'notebook-accel:open-panel'
};

function activate(
  app: JupyterFrontEnd,
  tracker: INotebookTracker,
  settings: ISettingRegistry | null,
  statusBar: IStatusBar | null,
  palette: ICommandPalette | null
): void {
  // The numProcesses setting; 0 (its default): the active kernel's config file's num_processes, else 2.
  let setting = 0;
  const links = new Map<NotebookPanel, KernelLink>();
  const linkOf = (panel: NotebookPanel | null) => (panel ? links.get(panel) : undefined);
  const processes = () => chooseProcesses(setting, linkOf(tracker.currentWidget)?.model.hello);
  const whence = () => {
    const choice = processes();
    if (choice.from === 'setting') {
      return 'the numProcesses setting';
    }
    const file = linkOf(tracker.currentWidget)?.model.hello?.config?.file;
    return choice.from === 'config'
      ? `num_processes in ${file ?? 'the config file'}`
      : 'the default (no numProcesses setting, no num_processes in the config file)';
  };
  let shownProcesses = 0; // the N the commands' labels last showed

  const status = new Widget();
  status.addClass('nacc-x-status');
  status.node.title = 'notebook_accel: click for launches and hardware';
  status.node.addEventListener('click', () => app.commands.execute(CommandIDs.openPanel));

  const sidebar = new Widget();
  sidebar.id = PANEL_ID;
  sidebar.addClass('nacc-x-panel');
  sidebar.title.icon = acceleratorIcon;
  sidebar.title.caption = 'notebook_accel sessions and launches';
  // A redraw between a button's pointerdown and pointerup would replace the button and lose the
  // click (running launches redraw every second): hold redraws while a pointer is down on the panel.
  let pressed = false;
  let pressedAt = 0;
  let heldDraw = false;
  sidebar.node.addEventListener('pointerdown', () => {
    pressed = true;
    pressedAt = Date.now();
  });
  const release = () => {
    if (!pressed) {
      return;
    }
    pressed = false;
    if (heldDraw) {
      heldDraw = false;
      window.setTimeout(() => draw(), 0); // after this pointerup's click
    }
  };
  window.addEventListener('pointerup', release, true);
  window.addEventListener('pointercancel', release, true);
  sidebar.node.addEventListener('click', event => {
    const action = (event.target as HTMLElement).closest('[data-action]')?.getAttribute('data-action');
    const link = linkOf(tracker.currentWidget);
    if (!action || !link) {
      return;
    }
    if (action === 'connect') {
      link.connect();
    } else if (action === 'start_session') {
      void app.commands.execute(CommandIDs.toggleSession);
    } else if (!link.send({ type: action })) {
      // "stop", "refresh", "restart" or "stop_session": the kernel acts and answers on the comm
      Notification.warning('notebook_accel: not connected to the kernel', { autoClose: 5000 });
    }
  });

  let drawnFor: NotebookPanel | null = null; // the notebook the sidebar shows
  const openFolds = () =>
    new Set(
      Array.from(sidebar.node.querySelectorAll<HTMLElement>('details[data-fold][open]'), d => d.dataset.fold ?? '')
    );

  const draw = () => {
    const panel = tracker.currentWidget;
    const link = linkOf(panel);
    const numProcesses = processes().n;
    if (numProcesses !== shownProcesses) {
      // A hello with the config's num_processes, another notebook, or the setting changed N.
      shownProcesses = numProcesses;
      app.commands.notifyCommandChanged(CommandIDs.runCell);
      app.commands.notifyCommandChanged(CommandIDs.toggleSession);
    }
    const text = link ? statusText(link.model, numProcesses) : 'not connected';
    status.node.textContent = `⚡ ${text}`;
    status.node.dataset.state = link?.model.current?.finished ? 'finished' : link?.model.current ? 'running' : '';
    if (link?.model.hello) {
      status.node.title = `notebook_accel: ${hardwareSummary(link.model.hello, numProcesses)}; click for details`;
    }
    if (pressed && Date.now() - pressedAt < 2000) {
      heldDraw = true; // (a press whose pointerup never came holds nothing for long)
    } else {
      // A fold (a stall's report) the person opened stays open across redraws, in its notebook.
      const open = drawnFor === panel ? openFolds() : new Set<string>();
      drawnFor = panel;
      const title = panel?.title.label ?? 'no notebook';
      sidebar.node.innerHTML = renderPanel(link?.model ?? new LaunchModel(), title, Date.now(), open);
    }
  };
  // Elapsed times move while a launch runs.
  window.setInterval(() => {
    const current = linkOf(tracker.currentWidget)?.model.current;
    if (current && !current.finished) {
      draw();
    }
  }, 1000);

  tracker.widgetAdded.connect((_, panel) => {
    const link = new KernelLink(panel.sessionContext);
    links.set(panel, link);
    link.changed.connect(() => {
      for (const notice of link.model.takeNotices()) {
        Notification[notice.level](`notebook_accel: ${notice.text}`, { autoClose: 5000 });
      }
      if (panel === tracker.currentWidget) {
        draw();
      }
    });
    panel.disposed.connect(() => {
      link.dispose();
      links.delete(panel);
    });
  });
  tracker.currentChanged.connect(draw);

  app.commands.addCommand(CommandIDs.openPanel, {
    label: 'Show notebook_accel launches',
    execute: () => {
      app.shell.activateById(PANEL_ID);
      draw();
    }
  });

  app.commands.addCommand(CommandIDs.runCell, {
    label: () => `Run cell on ${processes().n} processes`,
    caption: () =>
      `Run the active cell with %%accelerate -n ${processes().n} (the cell is not edited); N is ${whence()}`,
    icon: acceleratorIcon,
    isEnabled: () => tracker.activeCell?.model.type === 'code',
    execute: async () => {
      const panel = tracker.currentWidget;
      const cell = tracker.activeCell;
      if (!panel || !(cell instanceof CodeCell)) {
        return;
      }
      const model = cell.model;
      const code = runCellCode(model.sharedModel.getSource(), processes().n);
      model.clearExecution();
      cell.outputHidden = false;
      model.executionState = 'running';
      model.trusted = true; // the person ran it: render its widgets (the launch panel), not their text
      try {
        const reply = await OutputArea.execute(code, cell.outputArea, panel.sessionContext, {
          cellId: model.sharedModel.getId()
        });
        model.executionCount = reply?.content.execution_count ?? null;
      } catch (err) {
        console.warn('notebook_accel: run cell failed', err);
      } finally {
        model.executionState = 'idle';
      }
    }
  });

  app.commands.addCommand(CommandIDs.toggleSession, {
    label: () => `Start / stop a session (${processes().n} workers)`,
    execute: async () => {
      const kernel = tracker.currentWidget?.sessionContext.session?.kernel;
      if (!kernel) {
        return;
      }
      let text = '';
      const future = kernel.requestExecute({ code: toggleSessionCode(processes().n), silent: false });
      future.onIOPub = msg => {
        const content = msg.content as any;
        if (msg.header.msg_type === 'stream') {
          text += content.text;
        } else if (msg.header.msg_type === 'error') {
          text += `${content.ename}: ${content.evalue}`;
        }
      };
      const reply = await future.done;
      const show = reply.content.status === 'ok' ? Notification.info : Notification.error;
      show(text.trim() || 'done', { autoClose: 5000 });
    }
  });

  if (palette) {
    for (const command of Object.values(CommandIDs)) {
      palette.addItem({ command, category: 'notebook_accel' });
    }
  }

  app.docRegistry.addWidgetExtension('Notebook', {
    createNew: (panel: NotebookPanel) => {
      const button = new CommandToolbarButton({ commands: app.commands, id: CommandIDs.runCell, label: '' });
      panel.toolbar.insertAfter('run', 'notebook-accel-run', button);
      return button;
    }
  });

  app.shell.add(sidebar, 'right', { rank: 900 });
  if (statusBar) {
    statusBar.registerStatusItem('notebook-accel:status', { item: status, align: 'left', rank: 4 });
  }

  if (settings) {
    const apply = (s: ISettingRegistry.ISettings) => {
      const value = s.get('numProcesses').composite;
      setting = typeof value === 'number' ? value : 0;
      draw(); // notifies the commands when N changed
    };
    settings
      .load(PLUGIN_ID)
      .then(s => {
        apply(s);
        s.changed.connect(apply);
      })
      .catch(err => console.warn('notebook_accel: settings not loaded', err));
  }
  draw();
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Status, launches and "Run cell on N processes" for notebook_accel kernels.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ISettingRegistry, IStatusBar, ICommandPalette],
  activate
};

export default plugin;
