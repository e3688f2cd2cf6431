// Checks of the Grafana dashboards' PromQL (dashboards/*.json).
//
//   node dashboards.js names DASHBOARD_OR_RULES... -- SOURCE...
//     every metric a panel (or an alert rules file) names is one the code exports: a
//     "meshtrain_..." name registered in the C++ SOURCEs (histograms by their base name);
//   node dashboards.js query PROMETHEUS_URL JOB DASHBOARD...
//     every panel's every query, with the variables set to the e2e job, returns data from
//     a Prometheus that scraped a real run. A query of the dashboard's GPU-only MFU series
//     (meshtrain_train_peak_flops, 0 on CPU) is reported as skipped when the run had no GPU.
'use strict';
const fs = require('fs');
const http = require('http');

function targets(files) {
  const out = [];
  for (const file of files) {
    if (!file.endsWith('.json')) {  // a rules file: its text as one query
      out.push({ file, panel: 'rules', refId: '-', expr: fs.readFileSync(file, 'utf8') });
      continue;
    }
    const d = JSON.parse(fs.readFileSync(file, 'utf8'));
    for (const p of d.panels) for (const t of p.targets) out.push({ file, panel: p.title, refId: t.refId, expr: t.expr });
  }
  return out;
}

function names(args) {
  const split = args.indexOf('--');
  const dashboards = args.slice(0, split), sources = args.slice(split + 1);
  const exported = new Set();
  for (const s of sources) for (const m of fs.readFileSync(s, 'utf8').matchAll(/"(meshtrain_[a-z0-9_]+)"/g)) exported.add(m[1]);
  let bad = 0, used = 0;
  for (const t of targets(dashboards)) {
    for (const m of t.expr.matchAll(/\bmeshtrain_[a-z0-9_]+/g)) {
      used++;
      const base = m[0].replace(/_(bucket|sum|count)$/, '');
      if (!exported.has(m[0]) && !exported.has(base)) {
        console.log(`${t.file}: panel "${t.panel}" ${t.refId} names ${m[0]}, which no source exports`);
        bad++;
      }
    }
  }
  if (used === 0) { console.log('no metric names found in the dashboards'); process.exit(1); }
  console.log(`${used} metric references checked against ${exported.size} exported names; ${bad} unknown`);
  process.exit(bad ? 1 : 0);
}

function get(url) {
  return new Promise((resolve, reject) => {
    http.get(url, { timeout: 10000 }, res => {
      let s = '';
      res.on('data', d => s += d).on('end', () => resolve(JSON.parse(s)));
    }).on('error', reject).on('timeout', function () { this.destroy(new Error('timeout: ' + url)); });
  });
}

async function query(args) {
  const [prom, job, ...dashboards] = args;
  let bad = 0, ok = 0, skipped = 0;
  for (const t of targets(dashboards)) {
    const expr = t.expr.replaceAll('$namespace', '.*').replaceAll('$job', job).replaceAll('$rank', '.*')
                       .replaceAll('$__rate_interval', '15s');
    const r = await get(`${prom}/api/v1/query?query=${encodeURIComponent(expr)}`);
    const n = r.status === 'success' ? r.data.result.length : 0;
    if (n > 0) { ok++; continue; }
    if (expr.includes('meshtrain_train_peak_flops')) {
      console.log(`skipped: no GPU: ${t.file} "${t.panel}" ${t.refId} (MFU needs a GPU's dense peak)`);
      skipped++;
      continue;
    }
    console.log(`${t.file}: panel "${t.panel}" ${t.refId} returns no data: ${expr}${r.error ? ' (' + r.error + ')' : ''}`);
    bad++;
  }
  console.log(`${ok} dashboard queries returned data, ${skipped} skipped, ${bad} empty`);
  process.exit(bad ? 1 : 0);
}

const [mode, ...rest] = process.argv.slice(2);
if (mode === 'names') names(rest);
else if (mode === 'query') query(rest).catch(e => { console.log(e.message); process.exit(1); });
else { console.log('usage: dashboards.js names|query ...'); process.exit(2); }
