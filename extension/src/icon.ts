import { LabIcon } from '@jupyterlab/ui-components';

// Three stacked bars: ranks side by side. jp-icon3 follows the light/dark theme.
const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <rect x="3" y="4" width="18" height="4" rx="1"/>
    <rect x="3" y="10" width="13" height="4" rx="1"/>
    <rect x="3" y="16" width="8" height="4" rx="1"/>
  </g>
</svg>`;

export const acceleratorIcon = new LabIcon({ name: 'notebook-accel:ranks', svgstr });
