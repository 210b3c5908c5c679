#!/usr/bin/env python3
# Module import graph of src/ (the library): prints any cycle between modules
# (a parent declaring its children is not an import) and the folder-level edges.
#   python3 scripts/check_cycles.py
import re,os,sys
files={}
for root,_,fs in os.walk('src'):
    if root.startswith('src/bin'): continue
    for f in fs:
        if f.endswith('.rs'):
            p=os.path.join(root,f)
            mod=p[4:-3].replace('/','::')
            if mod.endswith('::mod'): mod=mod[:-5]
            if mod=='lib': mod=''
            files[mod]='\n'.join(l for l in open(p).read().splitlines() if not l.strip().startswith('//'))
mods=set(files)
def resolve(path, cur):
    parts=path.split('::')
    if parts[0]=='crate': base=[]; parts=parts[1:]
    elif parts[0]=='super':
        base=cur.split('::')[:-1] if cur else []
        parts=parts[1:]
        while parts and parts[0]=='super': base=base[:-1]; parts=parts[1:]
    else: return None
    full=base+parts
    for n in range(len(full),-1,-1):
        m='::'.join(full[:n])
        if m in mods: return m
edges={m:set() for m in mods}
for m,t in files.items():
    for u in re.findall(r'\b((?:crate|super)(?:::\w+)+)',t):
        r=resolve(u,m)
        if r is not None and r!=m: edges[m].add(r)
def is_anc(a,b): return a=='' or b.startswith(a+'::')
E={m:{d for d in ds if not is_anc(d,m) and not is_anc(m,d)} for m,ds in edges.items()}
index={};low={};st=[];on=set();res=[];i=[0]
sys.setrecursionlimit(10000)
def sc(v):
    index[v]=low[v]=i[0];i[0]+=1;st.append(v);on.add(v)
    for w in E[v]:
        if w not in index: sc(w); low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],index[w])
    if low[v]==index[v]:
        comp=[]
        while True:
            w=st.pop();on.discard(w);comp.append(w)
            if w==v: break
        if len(comp)>1: res.append(comp)
for v in E:
    if v not in index: sc(v)
print("module cycles (parent/child declarations excluded):", res)
def top(m): return m.split('::')[0]
F={}
for m,ds in E.items():
    for d in ds:
        if top(m)!=top(d): F.setdefault(top(m),set()).add(top(d))
for k in sorted(F): print(' ',k,'->',', '.join(sorted(F[k])))
