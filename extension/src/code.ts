// The Python the commands send. A JSON string literal is also a valid Python string literal.

const SESSION = "__import__('notebook_accel.jupyter.kernel_session', fromlist=['current']).current()";

/** Run `source` through %%accelerate without editing the cell; a running session keeps its workers. */
export function runCellCode(source: string, numProcesses: number): string {
  const options = JSON.stringify(`-n ${numProcesses} --port auto`);
  return `get_ipython().run_cell_magic('accelerate', '' if ${SESSION} else ${options}, ${JSON.stringify(source)})`;
}

/** `%accelerate stop` when a session runs, else `%accelerate start -n N`. */
export function toggleSessionCode(numProcesses: number): string {
  return `get_ipython().run_line_magic('accelerate', 'stop' if ${SESSION} else 'start -n ${numProcesses}')`;
}
