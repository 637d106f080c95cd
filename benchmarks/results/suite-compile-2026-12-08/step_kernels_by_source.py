import re, collections, sys
txt = open(sys.argv[1]).read()
files = dict(re.findall(r'^(\d+) "([^"]+)"', txt.split("FunctionNames")[0].split("FileNames")[1], re.M))
funcs = dict(re.findall(r'^(\d+) "([^"]+)"', txt.split("FileLocations")[0].split("FunctionNames")[1], re.M))
locs = {a:(b,c,d) for a,b,c,d in re.findall(r'^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)', txt.split("StackFrames")[0].split("FileLocations")[1], re.M)}
frames = {a:(b,c) for a,b,c in re.findall(r'^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)', txt.split("StackFrames")[1], re.M)}
def where(fid, depth=int(sys.argv[2]) if len(sys.argv)>2 else 1):
    # the stack's frames in this repository, innermost first, up to `depth`
    out=[]
    while fid in frames and len(out)<depth:
        l,p = frames[fid]; f,fn,line = locs[l]
        path = files[f]
        if "/work/main/" in path: out.append(path.split("/work/main/")[1]+":"+funcs[fn])
        if p==fid: break
        fid = p
    return " < ".join(out) or "?"
body = txt[txt.index("\n%", txt.index("StackFrames")):]
comps = re.split(r"\n\n", body)
c = collections.Counter(); n=0
for comp in comps:
    head = comp.strip().split("\n",1)[0]
    if "_computation" in head.split("(")[0]: continue  # a fusion's body (fused_/wrapped_..._computation)
    sig = head.split("->")[0]
    if not re.search(r"\[\d", sig) and "ENTRY" not in head: continue  # scalar-only: a reducer or comparator
    for line in comp.split("\n")[1:]:
        m = re.match(r"\s+(?:ROOT )?\S+ = .*? (\w[\w-]*)\(", line)
        if not m: continue
        op = m.group(1)
        if op in ("parameter","get-tuple-element","tuple","constant","bitcast"): continue
        s = re.search(r"stack_frame_id=(\d+)", line)
        c[where(s.group(1)) if s else "?"] += 1; n+=1
print("kernels", n)
for k,v in c.most_common(int(sys.argv[3]) if len(sys.argv)>3 else 40): print(f"{v:5d} {k}")
