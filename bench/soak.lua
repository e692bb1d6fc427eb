-- wrk script for the soak: POST the bodies of a manifest in turn, each connection
-- waiting DELAY_MS between requests (so the rate is a set fraction of capacity), and
-- count the answers by status. Prints one JSON line of results at the end.
-- usage: wrk -s soak.lua URL -- MANIFEST DELAY_MS
local bodies = {}
local counter = 0
local pause = 0
local threads = {}
statuses = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  for line in io.lines(args[1]) do
    local path, header_length = line:match("^(%S+) (%d+)$")
    local f = assert(io.open(path, "rb"))
    local body = f:read("*a")
    f:close()
    local headers = {["Content-Type"] = "application/json"}
    if tonumber(header_length) > 0 then
      headers["Content-Type"] = "application/octet-stream"
      headers["Inference-Header-Content-Length"] = header_length
    end
    table.insert(bodies, wrk.format("POST", nil, headers, body))
  end
  counter = math.random(#bodies)
  pause = tonumber(args[2])
end

function delay()
  return pause
end

function request()
  counter = counter % #bodies + 1
  return bodies[counter]
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
end

function done(summary, latency, requests)
  local e = summary.errors
  local parts = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses")) do
      table.insert(parts, string.format('"%s":%d', status, count))
    end
  end
  io.write(string.format(
    'RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,' ..
    '"connect":%d,"read":%d,"write":%d,"timeout":%d,"statuses":{%s}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.timeout, table.concat(parts, ",")))
end
